"""Synthetic Llama-3.2-1B-shaped decode step, hand-built (no pass pipeline), on the megakernel.

python -m amk.backends.cuda.bench_llama_shape [--layers 16] [--ctx 1024]
Prints compile time, ms/step, achieved GB/s and the copy-bandwidth floor measured in the same run.
Round-robin queues (no `place` pass), so this is a lower bound on what placement can give.
"""
from __future__ import annotations

import argparse
import time

import torch

from amk.program.ir import BufferKind as BK, DType as D, InstructionKind as K
from amk.backends.cuda.examples import Builder


def build(layers=16, H=2048, nh=32, nkv=8, hd=64, F=8192, V=128256, S=2048,
          tq=16, tf=64, tv=128):
    b = Builder("llama_shape")
    bf = D.BF16
    ids = b.buf("ids", BK.IO_INPUT, D.I32, (1,))
    pos = b.buf("pos", BK.IO_INPUT, D.I32, (1,))
    emb = b.buf("embed", BK.WEIGHT, bf, (V, H))
    inv = b.buf("inv_freq", BK.CONST, D.F32, (hd // 2,))
    x = b.buf("x0", BK.ACTIVATION, bf, (1, H))
    cx = b.task(K.EMBED, [ids, emb], [x])
    ready = [(cx, 1)]

    def gemv(xin, w, out, N, tile, waits, fused_norm=None):
        c = b.counter()
        for n0 in range(0, N, tile):
            nt = min(tile, N - n0)
            if fused_norm is None:
                b.task(K.GEMV_TILE, [xin, w], [out], {"n_off": n0, "N_tile": nt, "K": b.buffers[xin].shape[-1]},
                       waits=waits, out_counter=c)
            else:
                Hk = b.buffers[xin].shape[-1]
                steps = [{"op": int(K.RMSNORM), "args": [{"in": 0}, {"in": 1}], "out": 0,
                          "params": {"eps": 1e-5}, "out_shape": [1, Hk], "out_dtype": "bfloat16"},
                         {"op": int(K.GEMV_TILE), "args": [{"s": 0}, {"in": 2}], "out": "final",
                          "params": {"n_off": n0, "N_tile": nt, "K": Hk}}]
                b.task(K.FUSED, [xin, fused_norm, w], [out], {"recipe": {"steps": steps}},
                       waits=waits, out_counter=c)
        return [(c, -(-N // tile))]

    for l in range(layers):
        p = f"l{l}."
        n1 = b.buf(p + "in_norm", BK.WEIGHT, bf, (H,))
        n2 = b.buf(p + "post_norm", BK.WEIGHT, bf, (H,))
        wq = b.buf(p + "wq", BK.WEIGHT, bf, (nh * hd, H))
        wk = b.buf(p + "wk", BK.WEIGHT, bf, (nkv * hd, H))
        wv = b.buf(p + "wv", BK.WEIGHT, bf, (nkv * hd, H))
        wo = b.buf(p + "wo", BK.WEIGHT, bf, (H, nh * hd))
        wg = b.buf(p + "wg", BK.WEIGHT, bf, (F, H))
        wu = b.buf(p + "wu", BK.WEIGHT, bf, (F, H))
        wd = b.buf(p + "wd", BK.WEIGHT, bf, (H, F))
        kc = b.buf(p + "k_cache", BK.KV_CACHE, bf, (S, nkv, hd))
        vc = b.buf(p + "v_cache", BK.KV_CACHE, bf, (S, nkv, hd))
        q = b.buf(p + "q", BK.ACTIVATION, bf, (1, nh * hd))
        k = b.buf(p + "k", BK.ACTIVATION, bf, (1, nkv * hd))
        v = b.buf(p + "v", BK.ACTIVATION, bf, (1, nkv * hd))
        qr = b.buf(p + "qr", BK.ACTIVATION, bf, (1, nh * hd))
        kr = b.buf(p + "kr", BK.ACTIVATION, bf, (1, nkv * hd))
        att = b.buf(p + "att", BK.ACTIVATION, bf, (1, nh * hd))
        o = b.buf(p + "o", BK.ACTIVATION, bf, (1, H))
        h = b.buf(p + "h", BK.ACTIVATION, bf, (1, H))
        g = b.buf(p + "g", BK.ACTIVATION, bf, (1, F))
        u = b.buf(p + "u", BK.ACTIVATION, bf, (1, F))
        a = b.buf(p + "a", BK.ACTIVATION, bf, (1, F))
        dn = b.buf(p + "d", BK.ACTIVATION, bf, (1, H))
        xn = b.buf(p + "xout", BK.ACTIVATION, bf, (1, H))
        wq_ = gemv(x, wq, q, nh * hd, tq, ready, n1)
        wk_ = gemv(x, wk, k, nkv * hd, tq, ready, n1)
        wv_ = gemv(x, wv, v, nkv * hd, tq, ready, n1)
        cq = b.task(K.ROPE, [q, pos, inv], [qr], {"head_dim": hd}, waits=wq_)
        ck = b.task(K.ROPE, [k, pos, inv], [kr], {"head_dim": hd}, waits=wk_)
        ckv = b.counter()
        b.task(K.KV_APPEND, [kr, pos], [kc], {}, waits=[(ck, 1)], out_counter=ckv)
        b.task(K.KV_APPEND, [v, pos], [vc], {}, waits=wv_, out_counter=ckv)
        ca = b.counter()
        rep = nh // nkv
        for gi in range(nkv):
            b.task(K.ATTENTION_TILE, [qr, kc, vc, pos], [att],
                   {"head_dim": hd, "n_heads": nh, "n_kv_heads": nkv, "h_off": gi * rep, "h_count": rep},
                   waits=[(cq, 1), (ckv, 2)], out_counter=ca)
        wo_ = gemv(att, wo, o, H, tq, [(ca, nkv)])
        cr = b.task(K.ADD, [x, o], [h], waits=wo_ + ready)
        wg_ = gemv(h, wg, g, F, tf, [(cr, 1)], n2)
        wu_ = gemv(h, wu, u, F, tf, [(cr, 1)], n2)
        cs = b.task(K.SILU_MUL, [g, u], [a], waits=wg_ + wu_)
        wd_ = gemv(a, wd, dn, H, tq, [(cs, 1)])
        cx = b.task(K.ADD, [h, dn], [xn], waits=wd_ + [(cr, 1)])
        x, ready = xn, [(cx, 1)]
    fn = b.buf("final_norm", BK.WEIGHT, bf, (H,))
    logits = b.buf("logits", BK.IO_OUTPUT, bf, (1, V))
    tok = b.buf("tok", BK.IO_OUTPUT, D.I32, (1,))
    lw = gemv(x, emb, logits, V, tv, ready, fn)                 # tied embeddings
    b.task(K.SAMPLE_ARGMAX, [logits], [tok], waits=lw)
    b.outputs = [tok, logits]
    return b.program()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    from amk.backends.cuda.runtime import CudaProgram
    t0 = time.perf_counter()
    prog = build(layers=a.layers)
    print(f"tasks {len(prog.tasks)}, build {time.perf_counter() - t0:.2f}s", flush=True)
    t0 = time.perf_counter()
    cp = CudaProgram(prog, "cuda", validate=False)
    print(f"CudaProgram {time.perf_counter() - t0:.2f}s timings {cp.timings} variants "
          f"{len(cp.lowered.variants)} regs {cp.kernel.num_regs} local {cp.kernel.local_bytes}", flush=True)
    binds, nbytes = {}, 0
    for bb in prog.buffers:
        if bb.kind in (BK.WEIGHT, BK.CONST, BK.KV_CACHE):
            t = (torch.randn(bb.shape, device="cuda") * 0.02).to(bb.dtype.torch)
            if bb.kind == BK.CONST:
                t = 1.0 / (500000 ** (torch.arange(0, 32, device="cuda") / 32))
            binds[bb.source] = t
            if bb.kind != BK.KV_CACHE:
                nbytes += t.numel() * t.element_size()
    nbytes += a.layers * 2 * a.ctx * 8 * 64 * 2
    binds["ids"] = torch.tensor([17], dtype=torch.int32, device="cuda")
    binds["pos"] = torch.tensor([a.ctx - 1], dtype=torch.int32, device="cuda")
    cp.run(binds)
    for _ in range(3):
        cp.run(binds, check=False)
    cp.check()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(a.iters):
        ev[0].record(); cp.launch(); ev[1].record(); torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    cp.check()
    times.sort()
    med = times[len(times) // 2]
    src = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        dst.copy_(src)
    e1.record(); torch.cuda.synchronize()
    bw = 2 * src.numel() * 2 * 5 / (e0.elapsed_time(e1) / 1e3)
    print(f"RESULT layers={a.layers} ctx={a.ctx} bytes={nbytes / 1e9:.3f}GB step median={med:.3f}ms "
          f"min={times[0]:.3f}ms achieved={nbytes / (med / 1e3) / 1e12:.2f}TB/s copy_bw={bw / 1e12:.2f}TB/s "
          f"floor={nbytes / bw * 1e3:.3f}ms", flush=True)


if __name__ == "__main__":
    main()
