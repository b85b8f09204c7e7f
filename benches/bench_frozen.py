#!/usr/bin/env python
"""Frozen-state benchmark: a LoRA fine-tune of a frozen base of --base-gb GB or more
(real transformers Llama, real peft adapters on every projection, the state_dict in
peft's order), in float32 and in bfloat16. Each round trains one real step (forward,
backward, AdamW over the adapters), then snapshots {"model": state_dict, "optimizer"}.

Measured per snapshot, the median over --puts puts after two warm ones (the first stores
the base, the second records its addresses), all in one run:
- tsck, default (watch_writes=True): stall (put_snapshot(blocking=False) returns), put
  time (the future's result: blocks hashed, written, ref moved), CPU time of the process
  over the put, bytes_new;
- tsck, watch_writes=False: the same state copied and hashed whole (the full snapshot);
- tsck, the adapters and their optimizer state alone (the peer of the target: stall and
  put time <= 2x these);
- torch.save of the adapters and their optimizer state into a file on the same disk;
- peft's save_pretrained (the adapters as safetensors, what peft users save).

    python benches/bench_frozen.py [--base-gb 1.0] [--puts 5] [--dir DIR] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402

GB = 10 ** 9
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(dtype: torch.dtype, base_gb: float):
    """A Llama of hidden 2048 with enough layers for base_gb, LoRA r=16 on every projection."""
    import transformers
    from peft import LoraConfig, get_peft_model
    hidden, inter, vocab = 2048, 5504, 32000
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * dtype.itemsize
    fixed = (2 * vocab * hidden + hidden) * dtype.itemsize
    layers = max(1, -(-int(base_gb * GB - fixed) // per_layer))
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        base = transformers.LlamaForCausalLM(cfg).to(dtype)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt, layers


def train_step(model, opt, g) -> None:
    ids = torch.randint(0, 32000, (1, 16), generator=g)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def adapters(model, opt) -> dict:
    return {"model": {k: v for k, v in model.state_dict().items() if "lora_" in k}, "optimizer": opt.state_dict()}


def measure_store(path: Path, model, opt, g, puts: int, *, watch: bool, only_adapters: bool) -> dict:
    stall, put, cpu, new = [], [], [], []
    with tsck.open_store(path, watch_writes=watch) as store:
        for i in range(puts + 2):
            train_step(model, opt, g)
            state = adapters(model, opt) if only_adapters else {"model": model.state_dict(),
                                                                 "optimizer": opt.state_dict()}
            c0, t0 = time.process_time(), time.perf_counter()
            fut = store.put_snapshot(state, ref="ft/main", step=i, blocking=False)
            t1 = time.perf_counter()
            info = fut.result()
            t2, c1 = time.perf_counter(), time.process_time()
            if i >= 2:
                stall.append(t1 - t0)
                put.append(t2 - t0)
                cpu.append(c1 - c0)
                new.append(info.bytes_new)
            total = info.bytes_total
    return {"stall": statistics.median(stall), "put": statistics.median(put), "cpu": statistics.median(cpu),
            "new": statistics.median(new), "total": total}


def measure_file(path: Path, model, opt, g, puts: int, how: str) -> dict:
    times, cpu, size = [], [], 0
    for i in range(puts + 2):
        train_step(model, opt, g)
        c0, t0 = time.process_time(), time.perf_counter()
        if how == "torch.save":
            f = path / f"adapters-{i}.pt"
            torch.save(adapters(model, opt), f)
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
            size = f.stat().st_size
        else:
            d = path / f"peft-{i}"
            model.save_pretrained(d)
            f = d / "adapter_model.safetensors"
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
            size = f.stat().st_size
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= 2:
            times.append(t1 - t0)
            cpu.append(c1 - c0)
    return {"stall": statistics.median(times), "put": statistics.median(times), "cpu": statistics.median(cpu),
            "new": size, "total": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-gb", type=float, default=1.0)
    ap.add_argument("--puts", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tsck-bench-frozen-", dir=args.dir))
    import peft
    import transformers
    print(f"# {os.cpu_count()} cores, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}, python {platform.python_version()}; stores and files under {root}")
    print(f"# uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    rows = []
    try:
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            model, opt, layers = build(dtype, args.base_gb)
            base = sum(v.nbytes for k, v in model.state_dict().items() if "lora_" not in k)
            lora = sum(v.nbytes for k, v in model.state_dict().items() if "lora_" in k)
            print(f"# {name}: {layers} layers, frozen base {base / GB:.2f} GB, adapters {lora / 1e6:.1f} MB "
                  f"(+ AdamW moments {2 * lora / 1e6:.1f} MB)")
            g = torch.Generator().manual_seed(1)
            for label, fn in [
                ("tsck (default)", lambda d: measure_store(d, model, opt, g, args.puts, watch=True, only_adapters=False)),
                ("tsck, watch_writes=False (full)", lambda d: measure_store(d, model, opt, g, args.puts, watch=False,
                                                                            only_adapters=False)),
                ("tsck, adapters alone", lambda d: measure_store(d, model, opt, g, args.puts, watch=True,
                                                                 only_adapters=True)),
                ("torch.save, adapters alone", lambda d: measure_file(d, model, opt, g, args.puts, "torch.save")),
                ("peft save_pretrained", lambda d: measure_file(d, model, opt, g, args.puts, "peft")),
            ]:
                d = root / f"{name}-{len(rows)}"
                d.mkdir()
                r = fn(d)
                shutil.rmtree(d, ignore_errors=True)
                rows.append((name, label, r))
                print(f"# {name:8s} {label:32s} stall {r['stall']:.4f} s  put {r['put']:.4f} s  cpu {r['cpu']:.4f} s  "
                      f"new {r['new'] / 1e6:.1f} MB of {r['total'] / 1e6:.1f} MB", flush=True)
            del model, opt
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print()
    print("| dtype | snapshot | stall s | put s | CPU s | new MB | x adapters alone (tsck): stall / put |")
    print("|---|---|---|---|---|---|---|")
    for name, label, r in rows:
        alone = next(x for n, lab, x in rows if n == name and lab == "tsck, adapters alone")
        print(f"| {name} | {label} | {r['stall']:.4f} | {r['put']:.4f} | {r['cpu']:.3f} | {r['new'] / 1e6:.1f} | "
              f"{r['stall'] / alone['stall']:.2f} / {r['put'] / alone['put']:.2f} |")


if __name__ == "__main__":
    main()
