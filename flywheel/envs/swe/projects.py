"""The open-source Python projects SWE tasks are synthesized from, pinned to exact versions.

Each project's source distribution (from the package index, with its test suite) is used as it
is: nothing is installed, the library is imported from its source tree through PYTHONPATH, and
its tests run with the project venv's pytest. Every project here needs no dependency beyond
pytest. `sources` are the files and folders whose code may be mutated (test files inside them
are skipped); `test_cmd` runs the suite from the repository root.

Verified (CPython 3.11, pytest 9.2, `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`): every suite below passes
except the tests listed as baseline failures by the build itself (e.g. toolz's
`test_has_version`, which needs installed package metadata); those are never used.
"""

from __future__ import annotations

from dataclasses import dataclass

PYTEST = "python -m pytest -q -p no:cacheprovider"


@dataclass(frozen=True)
class Project:
    name: str
    """The package index name; also the task's `repo`."""
    version: str
    sdist_sha256: str
    """Checked after download: the pinned sdist, byte for byte."""
    sources: tuple[str, ...]
    """Mutable code: package folders or modules, relative to the repository root."""
    test_cmd: str
    pythonpath: str = "."
    """Relative to the repository root; what `import <package>` needs."""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


PROJECTS: dict[str, Project] = {p.name: p for p in (
    Project("tinydb", "4.9.0", "6928b1fa785186bda7952a0ba05aaeedc883ede565ca9c7d608de44e5e75de70",
            ("tinydb",), f"{PYTEST} tests"),
    Project("addict", "2.4.0", "b3b2210e0e067a281f5646c8c5db92e99b7231ea8b0eb5f74dbdf9e259d4e494",
            ("addict",), f"{PYTEST} test_addict.py"),
    Project("xmltodict", "1.0.4", "6d94c9f834dd9e44514162799d344d815a3a4faec913717a9ecbfa5be1bb8e61",
            ("xmltodict.py",), f"{PYTEST} tests"),
    # Its pytest config asks for pytest-cov and doctests of the README: `-o addopts=` drops both.
    Project("parse", "1.22.4", "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
            ("parse",), f"{PYTEST} -o addopts= tests"),
    Project("isodate", "0.7.2", "4cd1aa0f43ca76f4a6c6c0292a85f40b35ec2e43e315b59f06e6d32171a953e6",
            ("src/isodate",), f"{PYTEST} tests", pythonpath="src"),
    Project("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            ("toolz", "tlz"), f"{PYTEST} toolz"),
    Project("sqlparse", "0.6.1", "ca722573f848ff2d30e40ea30f53a104b7dea7635ea9285891263eb2c58fb6e7",
            ("sqlparse",), f"{PYTEST} tests"),
)}
