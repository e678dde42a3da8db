"""`flywheel.privacy` offline: in a fresh process whose sockets refuse to connect (and whose proxy is
a closed port) the detector finds what it should without trying the network once, builds its one
engine once for eight threads asking at once, imports nothing heavy until asked, and writes nothing
under HOME; the stock tldextract it replaces does try the network (the control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFFLINE_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys, threading

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(repr(args[:2])[:80])
        raise OSError("network disabled by the test")

    socket.socket.connect = socket.socket.connect_ex = refuse
    socket.create_connection = socket.getaddrinfo = refuse

    import flywheel.privacy as privacy
    light_import = not any(name.startswith(("presidio", "spacy", "tldextract")) for name in sys.modules)

    texts = ["mail jane.doe@example.com or o'brien@mail.example.co.uk", "call +44 20 7946 0958",
             "card 4111 1111 1111 1111", "SSN 536-22-8731", "nothing here, version 1.2.3"]
    results, start = {}, threading.Barrier(8)

    def worker(i):
        start.wait()  # all threads ask for the engine at once: it must still be built once
        results[i] = [[(f.type, f.start, f.end) for f in privacy.find(t)] for t in texts]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()

    from flywheel.privacy import engine
    found, builds, ours = results[0], engine.builds, list(attempts)
    same = all(results[i] == found for i in range(8))

    # control: the stock extractor Presidio's e-mail recognizer calls does go for the network
    import tldextract
    tldextract.TLDExtract(cache_dir=None)("jane.doe@example.com")
    print(json.dumps({"light_import": light_import, "found": found, "same": same, "builds": builds,
                      "ours": ours, "control": len(attempts) - len(ours)}))
""")


def test_works_offline_without_touching_the_network(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLDEXTRACT")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), FLYWHEEL_CACHE=str(tmp_path / "cache"),
               HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="",
               http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ours"] == [], out["ours"]  # no connection, no DNS lookup
    assert out["control"] > 0  # the patched sockets do catch an attempt
    assert out["light_import"] and out["same"] and out["builds"] == 1
    assert out["found"] == [
        [["EMAIL_ADDRESS", 5, 25], ["EMAIL_ADDRESS", 29, 55]],
        [["PHONE_NUMBER", 5, 21]],
        [["CREDIT_CARD", 5, 24]],
        [["US_SSN", 4, 15]],
        [],
    ]
    assert list(home.rglob("*")) == [], "nothing may be written under HOME (no suffix-list cache)"
