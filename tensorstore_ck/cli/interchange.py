"""Files in and out: checkout (a file or a model folder), export-weights, import."""

from __future__ import annotations

from .common import wants_bar, human, emit

__all__ = ["cmd_checkout", "cmd_export_weights", "cmd_import"]


def cmd_checkout(store, args):
    from ..interchange.export import export_file
    r = export_file(store, args.target, args.dest, fmt=args.format, path=args.path, force=args.force,
                    progress=wants_bar(args))
    if r["format"] == "hf-folder":
        cfg = "with config.json" if r["config"] else "no config.json: the snapshot carries none"
        emit(args, r, f"wrote the model folder {r['dest']} ({r['tensors']} tensors in {', '.join(r['files'])}; "
                      f"{cfg}; {human(r['bytes'])}) from {r['root'][:16]}")
        return 0
    what = f"{r['tensors']} tensors, {r['metadata']} metadata entries" if r["format"] == "safetensors" else \
        "torch.save of a Lightning checkpoint" if r["format"] == "lightning" else "torch.save"
    hint = ""
    if r["format"] == "safetensors" and r["path"] is None and r["metadata"] > 1:
        import shlex  # a whole training state (step, RNG, ... as metadata): not what load_state_dict takes
        hint = (f"\n(the whole snapshot, names from its top; the model's weights alone, as its load_state_dict "
                f"takes them: tsck export-weights {shlex.quote(args.store)} {shlex.quote(args.target)} "
                f"FILE.safetensors [--dtype bf16])")
    emit(args, r, f"wrote {r['dest']} ({r['format']}: {what}; {human(r['bytes'])}) from {r['root'][:16]}{hint}")
    return 0


def cmd_export_weights(store, args):
    from ..interchange.export import export_weights
    r = export_weights(store, args.target, args.dest, subtree=args.path, dtype=args.dtype,
                       strip_prefix=args.strip_prefix, force=args.force, progress=wants_bar(args))
    names = [f"{r['subtree']}." if r["subtree"] else None, *r["stripped"]]
    parts = [f"{r['tensors']} tensors", *([f"{r['cast']} cast to {r['dtype']}"] if r["dtype"] else []),
             f"names without {', '.join(repr(n) for n in names if n)}" if any(names) else "names as stored"]
    text = f"wrote {r['dest']} (safetensors: {'; '.join(parts)}; {human(r['bytes'])}) from {r['root'][:16]}"
    if r["skipped"]:
        more = f" and {len(r['skipped']) - 8} more" if len(r["skipped"]) > 8 else ""
        text += f"\nleft out {len(r['skipped'])} values that are not tensors: {', '.join(r['skipped'][:8])}{more}"
    emit(args, r, text)
    return 0


def cmd_import(store, args):
    from ..interchange.importing import import_files
    i = import_files(store, args.ref, args.files, step=args.step, job=args.job, progress=wants_bar(args))
    emit(args, i.to_json(), f"imported {len(args.files)} input(s) as {i.ref} -> {i.root}\n"
                            f"{human(i.bytes_total)} in {i.blocks_total} blocks; {human(i.bytes_new)} in "
                            f"{i.blocks_new} blocks were new")
    return 0
