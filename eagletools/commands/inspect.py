"""`eagletools inspect`: what a draft checkpoint is, and whether it fits a target."""

from __future__ import annotations

import argparse
from typing import Any

from eagletools.commands import add_command
from eagletools.commands.convert import add_allow_pickle, add_engine_choice


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "inspect",
        "Show a draft checkpoint's format, config, sizes, vocabulary invariants and aux "
        "layers; with --target, every incompatibility and its fix (exit 1 if any)",
        "eagletools inspect runs/draft-vllm --target smollm2-135m",
    )  # fmt: skip
    p.add_argument("ckpt", help="checkpoint folder (format detected)")
    p.add_argument("--target", help="check compatibility with this target")
    add_engine_choice(p, "--engine", "also say whether ENGINE computes this draft as trained "
                      "(exit 1 if not)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_allow_pickle(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from eagletools.formats import load_checkpoint
    from eagletools.formats.describe import describe

    ckpt = load_checkpoint(args.ckpt, allow_pickle=args.allow_pickle)
    target = None
    if args.target:
        from eagletools.targets import load_target_summary

        target = load_target_summary(args.target)
    report = describe(ckpt, target)
    if args.for_engine:
        add_engine_report(report, ckpt.config, args.for_engine, target)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


def add_engine_report(report: dict[str, Any], config: Any, engine: str, target: Any) -> None:
    """The options `engine` ignores, with their recipe fields; any makes the report fail."""
    from eagletools.formats.engines import unsupported

    layers = target.info.num_layers if target is not None else None
    ignored = unsupported(config, engine, layers)
    report["engine"] = {
        "name": engine,
        "ignored": [{"option": o.name, "recipe_field": o.recipe_field} for o in ignored],
        "aux_ids_checked": layers is not None,
    }
    report["ok"] = report["ok"] and not ignored


def render(r: dict[str, Any]) -> str:
    c = r["config"]
    v = r["vocab"]
    lines = [
        f"{r['path']}: {r['format']} format",
        f"  layers: {c['num_hidden_layers']}, hidden {c['hidden_size']}, intermediate "
        f"{c['intermediate_size']}, heads "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} kv, head_dim {c['head_dim']}, "
        f"qk_norm {c['qk_norm']}, norm_before_residual {c['norm_before_residual']}",
        f"  fc: {c['num_aux_states']} aux states x target hidden {c['target_hidden_size']}",
        f"  RoPE: theta {c['rope_theta']}, scaling {c['rope_scaling']}, max positions "
        f"{c['max_position_embeddings']}",
        f"  parameters: {r['parameters']:,} (+ {r['embedding_parameters']:,} embeddings)",
        "  dtypes: " + ", ".join(f"{k} x{n}" for k, n in sorted(r["dtypes"].items())),
        f"  vocab: draft {v['draft_vocab_size']} of target {v['target_vocab_size']}"
        + (" (identity)" if v["identity"] else ""),
    ]
    for check in v["checks"]:
        detail = f" ({check['detail']})" if check["detail"] else ""
        lines.append(f"    [{'ok' if check['ok'] else 'FAIL'}] {check['check']}{detail}")
    aux = r["aux_layer_ids"]
    if aux is None:
        lines.append("  aux layers: not recorded (engines assume [2, N//2, N-3], HF indexing)")
    else:
        lines.append(
            f"  aux layers: {aux['hf_hidden_states']} as HF hidden-state indices (speculators, "
            f"vLLM) = {aux['decoder_layer_outputs']} as decoder-layer outputs (eagle_config, "
            "SGLang)"
        )
    if "target" in r:
        lines.append(f"  target {r['target']}: " + ("compatible" if not r["problems"] else ""))
        for p in r["problems"]:
            kind = "error" if p["error"] else "warning"
            lines.append(f"    {kind}: {p['field']}: {p['message']}; fix: {p['fix']}")
    if "engine" in r:
        e = r["engine"]
        lines.append(f"  engine {e['name']}: " + ("computes it as trained" if not e["ignored"]
                     else "would compute it differently, without an error"))  # fmt: skip
        for item in e["ignored"]:
            lines.append(f"    ignores {item['option']} (recipe field {item['recipe_field']})")
        if not e["aux_ids_checked"]:
            lines.append("    (aux ids not checked: pass --target)")
    return "\n".join(lines)
