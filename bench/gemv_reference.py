"""cuBLAS batch-1 GEMV speed on the Llama-3.2-1B weight shapes (CUDA graph of 20): the rate a
single GEMV op reaches on this GPU, to compare with the megakernel's GB/s per SM."""
import torch, time
for (n, k) in [(16384, 2048), (2048, 8192), (2048, 2048)]:
    W = torch.randn(n, k, device="cuda", dtype=torch.bfloat16); x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): y = x @ W.t()
    torch.cuda.synchronize(); g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20): y = x @ W.t()
    g.replay(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): g.replay()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 200
    print(f"cuBLAS x@W.T W[{n},{k}] bf16: {dt*1e6:.1f} us, {n*k*2/dt/1e12:.2f} TB/s")
