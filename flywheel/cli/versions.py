"""`flywheel versions`: the policy versions of a running Flywheel, and an operator's say.

    flywheel versions list                 every version: state, lineage, gate, online reward
                                           (then each shared or tenant adapter's, under promotion)
    flywheel versions show N [--adapter A] one version (of adapter A): transitions, gate report, canary
    flywheel versions promote N            serve N to everyone (an operator's decision)
    flywheel versions rollback [N]         take back the canary, else the serving version
                                           (to N, or to the last good version)
    flywheel versions pin N | unpin        serve N and promote nothing automatically, or resume
    ... promote | rollback | pin | unpin --adapter A
                                           the same on a shared or tenant adapter's line
                                           (its version 0: its start, the bare base)
    flywheel versions adapters [--tenant T [--user U]]
                                           the LoRA adapters (`adapters.kind: lora`) and their
                                           versions in the store: all, a tenant's, or one user's
    flywheel versions rollback [N] --tenant T --user U
                                           an end user's own adapter back to its version N (0:
                                           its start), else to the one before its newest; with
                                           promotion.mode off, `--adapter A` does the same for a
                                           shared or tenant adapter

It finds the deployment's bus as the other subcommands do: from `--config FILE` and `key=value`
(`bus.url`, else the `bus.url` file in `run_dir`, default `runs/local`). Reading needs only the registry; commands are carried out by the promotion loop, in
order, and this waits for each one's result (exit status 1 when it was refused, 2 when no
promotion loop answered). `adapters` reads the adapter store in `run_dir/adapters` (no bus).
An adapter's rollback where no promotion loop has its line is the trainer's to carry out
(flywheel/versions/adapter_rollback.py): this waits for its answer likewise (1 refused, 2 no
trainer answered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flywheel.bus import Bus
from flywheel.cli.arguments import add_config, bus_url, load
from flywheel.models.adapter_names import user_adapter
from flywheel.models.adapter_store import AdapterStore
from flywheel.versions.adapter_rollback import request_rollback
from flywheel.versions.records import Routing, VersionEntry
from flywheel.versions.registry import Registry, send_command


def _when(at: float) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(at))


def _role(entry: VersionEntry, routing: Routing | None) -> str:
    if routing is None:
        return ""
    canary = routing.canary_of(entry.adapter)
    if canary is not None and canary.version == entry.version:
        return f"canary, {routing.canary_share:.0%} of new sessions" + (f" of {entry.adapter}" if entry.adapter else "")
    if entry.adapter is not None:
        serving = routing.adapters.get(entry.adapter)
        return f"serves {entry.adapter}'s requests" if serving is not None and serving.version == entry.version else ""
    if routing.serving.version == entry.version:
        return "serves everyone" + (" (pinned)" if routing.pinned else "")
    return ""


def _suite(name: str, suite: dict) -> str:
    if suite.get("source") == "traffic":  # how often the pinned judge preferred each version's reply
        return f"{name} preferred {suite['wins']} vs {suite['losses']} of {suite['items']}"
    return f"{name} {suite['candidate']:.2f} vs {suite['serving']:.2f}"


def _gate(entry: VersionEntry) -> str:
    if entry.waiting:
        return f"waiting: {entry.waiting}"
    if not entry.gate:
        return "-"
    suites = ", ".join(_suite(name, s) for name, s in entry.gate["suites"].items())
    return f"{'passed' if entry.gate['passed'] else 'failed'}: {suites}; KL {entry.gate['guards'].get('kl', 0):.3f}"


def version_table(entries: list[VersionEntry], routing: Routing | None, adapter: str | None = None) -> Table:
    table = Table(title="policy versions" if adapter is None else f"versions of adapter {adapter}", title_justify="left")
    for column in ("version", "state", "parent", "step", "trained on", "train reward", "gate", "online reward", "since", "why"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        last = entry.transitions[-1] if entry.transitions else None
        sessions, reward = entry.online_reward()
        table.add_row(
            f"v{entry.version}", entry.state + (f"\n{_role(entry, routing)}" if _role(entry, routing) else ""),
            "-" if entry.parent is None else f"v{entry.parent}", str(entry.step),
            f"{entry.trained_on.get('samples', '-')} samples",
            "-" if "reward_mean" not in entry.metrics else f"{entry.metrics['reward_mean']:.3f}",
            _gate(entry), "-" if reward is None else f"{reward:.3f} ({sessions})",
            _when(last.at) if last else "-", f"{last.by}: {last.reason}" if last else "-",
        )
    return table


def adapter_table(store: AdapterStore, tenant: str | None, user: str | None) -> Table:
    """The store's adapters (a tenant's: its own and its users'; one user's), newest version first."""
    names = store.names()
    if user is not None:
        names = [n for n in names if n == user_adapter(str(tenant), user)]
    elif tenant is not None:
        names = [n for n in names if n == tenant or n.startswith(f"{tenant}.")]
    table = Table(title=f"adapters in {store.root}", title_justify="left")
    for column in ("adapter", "versions", "newest written", "size"):
        table.add_column(column, overflow="fold")
    for name in names:
        versions = store.versions(name)
        newest = store.path(name, versions[-1])
        size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        table.add_row(name, " ".join(f"v{v}" for v in reversed(versions)), _when(newest.stat().st_mtime), f"{size / 1e6:.1f} MB")
    return table


def show(console: Console, entry: VersionEntry, routing: Routing | None) -> None:
    console.print(f"[bold]{entry.id}[/bold]  {entry.state}  {_role(entry, routing)}")
    console.print(f"parent: {'-' if entry.parent is None else f'v{entry.parent}'}   step {entry.step}   weights: {entry.path}")
    trained = {k: v for k, v in entry.trained_on.items() if k != "sample_digests"}
    console.print(f"trained on: {json.dumps(trained)}   metrics: {json.dumps(entry.metrics)}", highlight=False)
    table = Table(title="transitions", title_justify="left")
    for column in ("when", "state", "by", "why"):
        table.add_column(column, overflow="fold")
    for t in entry.transitions:
        table.add_row(_when(t.at), t.state, t.by, t.reason)
    console.print(table)
    console.print(f"gate: {_gate(entry)}", highlight=False)
    for name, part in (("gate report", entry.gate), ("canary", entry.canary)):
        if part:
            console.print(f"[bold]{name}[/bold]: {json.dumps(part, indent=1, default=str)}", highlight=False)


def _said(console: Console, ok: bool, message: str) -> int:
    """Print a command's result; its exit status."""
    console.print(("done: " if ok else "refused: ") + message, highlight=False)
    return 0 if ok else 1


async def run(args: argparse.Namespace, url: str, console: Console, adapters: Path,
              trainers: tuple[str, str] | None) -> int:
    """The command on the bus; `trainers`: (adapter, whose) when its rollback is the trainer's
    (the version before its newest read from the store in `adapters`)."""
    bus = await Bus.connect(url, name="versions-cli")
    try:
        if trainers is not None:  # an adapter no promotion loop has a line of: the trainer's to take back
            name, target = trainers
            result = await request_rollback(bus, AdapterStore(adapters), name, target, args.version, args.reason, args.operator,
                                            args.timeout_s)
            return _said(console, result.ok, result.message)
        registry = await Registry.open(bus)
        routing = await registry.routing()
        if args.action == "list":
            console.print(version_table(await registry.versions(), routing))
            for adapter in await registry.adapters():
                console.print(version_table(await registry.versions(adapter=adapter), routing, adapter))
            return 0
        if args.action == "show":
            entry = await registry.get(args.version, args.adapter)
            if entry is None:
                console.print(f"no version {args.version} {'of ' + args.adapter + ' ' if args.adapter else ''}in the registry")
                return 1
            show(console, entry, routing)
            return 0
        result = await send_command(bus, registry, args.action, args.version, reason=args.reason, operator=args.operator,
                                    timeout_s=args.timeout_s, adapter=args.adapter)
        return _said(console, result.ok, result.message)
    except TimeoutError as exc:
        console.print(str(exc))
        return 2
    finally:
        await bus.close()


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = __doc__.split("\n\n")[0].split(": ", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("action", choices=["list", "show", "promote", "rollback", "pin", "unpin", "adapters"])
    parser.add_argument("version", nargs="?", type=lambda s: int(s.lstrip("v")), help="N or vN")
    parser.add_argument("--reason", default="", help="why (kept in the version's history)")
    parser.add_argument("--operator", default="cli", help="who (kept in the version's history)")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--adapter", help="show, promote, rollback, pin, unpin: on this shared or tenant adapter's line "
                                          "(rollback with promotion.mode off: the trainer takes the adapter back)")
    parser.add_argument("--tenant", help="adapters: this tenant's only; rollback: with --user")
    parser.add_argument("--user", help="adapters: this end user's (with --tenant); rollback: their own adapter's")
    add_config(parser)
    parser.set_defaults(run=main, parser=parser)


def main(args: argparse.Namespace) -> int:
    if args.action in ("show", "promote", "pin") and args.version is None:
        args.parser.error(f"{args.action} needs a version")
    if args.action in ("list", "unpin", "adapters") and args.version is not None:
        args.parser.error(f"{args.action} takes no version")
    if args.user is not None and args.tenant is None:
        args.parser.error("--user needs --tenant")
    if args.adapter is not None and args.action in ("list", "adapters"):
        args.parser.error(f"{args.action} takes no --adapter (list shows every line)")
    if args.user is not None and args.action not in ("adapters", "rollback"):
        args.parser.error(f"{args.action} takes no --user (an end user's adapter: adapters, rollback)")
    if args.user is not None and args.adapter is not None:
        args.parser.error("rollback takes --adapter (a line under promotion) or --tenant and --user, not both")
    if args.tenant is not None and args.user is None and args.action == "rollback":
        args.parser.error("rollback --tenant needs --user (a tenant's adapter's line: --adapter)")
    config = load(args)
    trainers = None
    if args.action == "rollback" and args.user is not None:
        trainers = (user_adapter(args.tenant, args.user), f"{args.tenant}/{args.user}")
    elif args.action == "rollback" and args.adapter is not None and not config.promotion.enabled:
        trainers = (args.adapter, args.adapter)
    if trainers is not None and config.adapters.kind != "lora":
        args.parser.error("rollback: the configuration trains no adapters (adapters.kind: none)")
    adapters = Path(config.run_dir) / "adapters"
    if args.action == "adapters":
        Console(width=160).print(adapter_table(AdapterStore(adapters), args.tenant, args.user))
        return 0
    return asyncio.run(run(args, bus_url(config), Console(width=160), adapters, trainers))
