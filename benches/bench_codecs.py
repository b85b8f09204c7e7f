"""Does compression pay on training state? lz4, byte-shuffle + lz4 and the float
codec (frame codec 3), per 4 MiB block, on one core.

Trains the demo's GPT-style model on real text for 40 steps (so the
weights and AdamW moments are not just their initial values), then for fp32
weights, bf16 weights, exp_avg, exp_avg_sq and the whole fp32 checkpoint
(weights + both moments) reports each codec's ratio (raw / stored, frame
headers included) and its compress and decompress speed in GB/s of raw bytes,
on one thread (best of --rounds: the machine is shared, the best round is the
one least disturbed). "float" is what a store opened with compression="float"
writes: the probe picks the float codec, lz4 or raw per block.

    .venv/bin/python benches/bench_codecs.py [--rounds 5] [--out benches/results/codecs.txt]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import lz4.block
import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from demo import CTX, TEXT, TinyGPT  # noqa: E402

from tensorstore_ck.format import frame  # noqa: E402

BLOCK = 4 << 20


def blocks_of(tensors):
    raw = np.concatenate([t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors])
    return [raw[i:i + BLOCK] for i in range(0, len(raw), BLOCK)]


def _encode(codec, b, itemsize):
    if codec == "lz4":
        return frame.encode_payload(b, frame.KIND_BLOCK)
    if codec == "shuffle+lz4":
        return frame.encode_payload(b, frame.KIND_BLOCK, shuffle_itemsize=itemsize)
    return frame.encode_payload(b, frame.KIND_BLOCK, float_itemsize=itemsize)


def measure(bl, itemsize, codec, rounds):
    """-> (ratio, compress GB/s, decompress GB/s, {codec id: blocks})."""
    total = sum(b.nbytes for b in bl)
    best_c = best_d = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        framed = [_encode(codec, b, itemsize) for b in bl]
        best_c = min(best_c, time.perf_counter() - t0)
        blobs = [b"".join(bytes(memoryview(x).cast("B")) for x in f) for f in framed]
        out = np.empty(BLOCK, dtype=np.uint8)
        t0 = time.perf_counter()
        for blob in blobs:
            hdr = frame.decode_header(blob)
            frame.decode_payload(hdr, memoryview(blob)[frame.HEADER_SIZE:], out[:hdr.raw_len])
        best_d = min(best_d, time.perf_counter() - t0)
    for blob, b in zip(blobs, bl):  # lossless, bit for bit
        hdr = frame.decode_header(blob)
        assert bytes(frame.decode_payload(hdr, memoryview(blob)[frame.HEADER_SIZE:])) == b.tobytes()
    used = {}
    for blob in blobs:
        used[blob[5]] = used.get(blob[5], 0) + 1
    return total / sum(len(x) for x in blobs), total / best_c / 1e9, total / best_d / 1e9, used


STEPS = 40


def train():
    torch.manual_seed(0)
    model = TinyGPT(d=384, layers=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - CTX - 1, (16,), generator=g)
        chunk = torch.stack([data[s:s + CTX + 1] for s in starts.tolist()])
        x, y = chunk[:, :-1], chunk[:, 1:]
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "codecs.txt"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, opt = train()
    params = list(model.parameters())
    st = [opt.state[p] for p in params]
    w32 = [p.detach() for p in params]
    m1 = [s["exp_avg"] for s in st]
    m2 = [s["exp_avg_sq"] for s in st]
    data = [
        ("fp32 weights", w32, 4),
        ("bf16 weights", [p.to(torch.bfloat16) for p in w32], 2),
        ("AdamW exp_avg (fp32)", m1, 4),
        ("AdamW exp_avg_sq (fp32)", m2, 4),
        # one tensor after another, as put_snapshot blocks them (each tensor its own blocks)
        ("whole fp32 checkpoint (weights + exp_avg + exp_avg_sq)", None, 4),
    ]
    lines = [f"# benches/bench_codecs.py --rounds {args.rounds}: TinyGPT(d=384, layers=6) after {STEPS} AdamW steps, "
             f"4 MiB blocks, one thread, best of {args.rounds} rounds",
             f"# {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, numpy {np.__version__}, "
             f"lz4 {lz4.library_version_string()}, pyzstd {frame.pyzstd.__version__} "
             f"(zstd {frame.pyzstd.zstd_version})",
             "| data | size | lz4 | byte-shuffle + lz4 | float (compression=\"float\") |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name, tensors, itemsize in data:
        if tensors is None:
            bl = [b for group in (w32, m1, m2) for t in group for b in blocks_of([t])]
        else:
            bl = [b for t in tensors for b in blocks_of([t])]
        total = sum(b.nbytes for b in bl)
        cells = []
        for codec in ("lz4", "shuffle+lz4", "float"):
            r, c, d, used = measure(bl, itemsize, codec, args.rounds)
            note = "" if codec != "float" else " [" + ", ".join(
                f"{ {0: 'raw', 1: 'lz4', 2: 'shuffle', 3: 'float'}[k]} {v}" for k, v in sorted(used.items())) + "]"
            cells.append(f"{r:.3f}x, {c:.2f} / {d:.2f} GB/s{note}")
        line = f"| {name} | {total / 1e6:.1f} MB | " + " | ".join(cells) + " |"
        print(line, flush=True)
        lines.append(line)
    lines.append("# cells: ratio raw/stored, compress / decompress GB/s of raw bytes on one core; "
                 "[codec blocks] = what the probe picked per block; lz4 and shuffle+lz4 keep a block raw when "
                 "its 64 KiB sample does not shrink to 90%, so where their ratio is ~1.000 their speed is a probe "
                 "and a copy")
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
