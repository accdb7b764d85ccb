// Ops the model families of issue 25 added (Gemma's soft-caps and tanh GELU, GPT-2's tanh
// GELU, slice / concat as COPY's column move), kept out of op_ew so its hot path is unchanged.
// Output (r, c) for c in [C0, C1) of every row reads x at r * A_RS + c + A_SHIFT; fp32 math,
// one rounding to TY (docs/PROGRAM.md).

// tanhf is the libdevice one: the reference is torch.tanh in fp32 (a few ulp apart at most).
template <int XKIND> __device__ __forceinline__ float ewx_apply(float x, float cap) {
  if (XKIND == EWX_SOFTCAP) return tanhf(x / cap) * cap;
  if (XKIND == EWX_GELU_TANH)
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  return x;
}

template <int XKIND, class TY, class TA>
__device__ __noinline__ void op_ewx(AMK_PARAMS) {
  const int C = d.ip[P_EWX_COLS], c0 = d.ip[P_EWX_C0], w = d.ip[P_EWX_C1] - c0;
  const long long R = d.ip[P_EWX_ROWS], ars = d.ip[P_EWX_A_RS], shift = d.ip[P_EWX_A_SHIFT];
  const float cap = d.fp[F_EWX_CAP];
  const TA* a = (const TA*)P[0];
  TY* y = (TY*)P[d.n_in];
  if (w <= 0) return;
  for (long long i = threadIdx.x; i < R * w; i += NT) {
    const long long r = i / w;
    const int c = c0 + (int)(i - r * w);
    const TA av = a[r * ars + c + shift];
    if (XKIND == EWX_COPY_COLS) y[r * C + c] = Cast<TY, TA>::go(av);
    else y[r * C + c] = from_f<TY>(ewx_apply<XKIND>(to_f(av), cap));
  }
}
