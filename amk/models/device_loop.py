"""The cuda backend's decode loop on the device: `sync_every` steps captured in one CUDA graph.

A captured step is: the megakernel's launch (it reads the program's own token and pos input
buffers and the bound kv caches: fixed addresses, which the graph bakes), the sampler on the
step's ids / logits, then one feedback kernel (amk/models/feedback.py): the new token into the
token buffer, pos += 1 in place, the EOS flag (done |= token == eos) and the step's slot of
tokens and flags; and the step's logits into their slot, when kept.
The host replays the graph, copies the slots to pinned memory and syncs once per replay to
stream the tokens, keeping the next replay in flight while it reads the last one (not when
logits are kept or on_token is given: those read the device slots before the next replay).

The first step runs eagerly: it warms the sampler's kernels on the loop's stream before the
capture (torch's advice), and its token is a real one. Steps that do not fill a replay run
eagerly too, so no step runs past max_new_tokens (no cache row past max_seq). The fault word
is mirrored into pinned memory after every replay and read after its sync (no fault lost; the
kernel's watchdog still turns a stuck schedule into a fault).

The loop and its graph are kept between generate calls (device_loop's `cache`, the Model's):
the graph bakes only fixed addresses (the program's tables, input and output buffers, the
loop's own tensors and its sampler's), so the next call with the same program, batch and
sampling filters rebinds, resets the loop's state in place and replays, with no capture inside
its timed decode (a capture is ~8 launches of host work: NOTES v22). A replay that raised
drops the graph: the next call captures again.
"""
from __future__ import annotations

import warnings

import torch


class DeviceLoop:
    def __init__(self, exe, bindings, out_shapes, sampler, token0: torch.Tensor, steps: int,
                 eos: int | None, keep_logits: bool):
        self.exe, self.sampler, self.steps, self.eos = exe, sampler, steps, eos
        exe.bind(bindings)                     # the checks; token and pos land in exe's buffers
        self.token_in = exe.input_buffer("token")
        self.pos_in = exe.input_buffer("pos")
        outs = exe.output_buffers()
        self.ids, self.logits = outs[0].view(out_shapes[0]), outs[1].view(out_shapes[1])
        batch, dev = token0.numel(), exe.device
        self.slots = torch.zeros(steps, 2, batch, dtype=torch.int32, device=dev)  # token, done
        self.done = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.logit_slots = (torch.empty((steps, *self.logits.shape), dtype=self.logits.dtype,
                                        device=dev) if keep_logits else None)
        self.host = [torch.zeros(steps, 2, batch, dtype=torch.int32, pin_memory=True)
                     for _ in range(2)]
        self.graph = None
        self._reset_done(token0)

    def _reset_done(self, token0: torch.Tensor) -> None:
        self.done.zero_()
        if self.eos is not None:
            self.done.copy_(token0.reshape(-1) == self.eos)  # the prefill's token may be EOS

    def restart(self, bindings, sampler, token0: torch.Tensor) -> None:
        """The next generate call on this loop: bind its tensors (token and pos into the same
        buffers), take the call's sampler state into the baked one, reset the EOS flags."""
        self.exe.bind(bindings)
        self.sampler.follow(sampler)
        self._reset_done(token0)

    def _step(self, k: int) -> None:
        """Step k of a replay: only stream work on fixed tensors (capturable)."""
        from amk.models.feedback import feedback     # triton: imported only where a GPU runs
        self.exe.launch()
        tok = self.sampler.next(self.logits, self.ids)
        feedback(tok, self.token_in, self.pos_in, self.slots[k], self.done, self.eos)
        if self.logit_slots is not None:
            self.logit_slots[k].copy_(self.logits)

    def _enqueue(self, n: int, host: torch.Tensor) -> torch.cuda.Event:
        if n == self.steps and self.graph is not None:
            self.graph.replay()
        else:
            for k in range(n):
                self._step(k)
        host.copy_(self.slots, non_blocking=True)
        self.exe.fault_mirror.after_launch()
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _wait(self, ev: torch.cuda.Event) -> None:
        ev.synchronize()
        if self.exe.fault_mirror.faulted():
            self.exe.check()                   # synchronises and raises the full report

    def _capture(self) -> None:
        g = torch.cuda.CUDAGraph()
        try:
            g.capture_begin()
            try:
                for k in range(self.steps):
                    self._step(k)
            finally:
                g.capture_end()
        except Exception as e:                 # eager steps still give the same tokens
            warnings.warn(f"amk generate: capturing {self.steps} decode steps in a CUDA graph "
                          f"failed ({type(e).__name__}: {e}); running them one by one")
            return
        self.graph = g

    def run(self, n: int, take) -> tuple[int, int]:
        """Run n steps; take(host slots [k, 2, B], device slots, logit slots) is called per
        synced chunk and returns True to stop. -> (steps run, graph replays)."""
        stream = torch.cuda.Stream(self.exe.device)
        stream.wait_stream(torch.cuda.current_stream(self.exe.device))
        ran = replays = 0
        try:
            with torch.cuda.device(self.exe.device), torch.cuda.stream(stream):
                self._wait(self._enqueue(1, self.host[0]))      # the warm-up step
                ran = 1
                if take(self.host[0][:1], self.slots[:1], self.logit_slots):
                    return ran, replays
                q, r = divmod(n - 1, self.steps)
                if q and self.graph is None:
                    stream.synchronize()
                    self._capture()
                depth = 0 if self.logit_slots is not None else 1
                chunks = [self.steps] * q + ([r] if r else [])
                events = {}
                for kind, j in chunk_order(len(chunks), depth):
                    h = self.host[j % 2]
                    if kind == "enqueue":
                        events[j] = self._enqueue(chunks[j], h)
                        ran += chunks[j]
                        replays += chunks[j] == self.steps and self.graph is not None
                        continue
                    self._wait(events.pop(j))
                    if take(h[:chunks[j]], self.slots[:chunks[j]], self.logit_slots):
                        return ran, replays
        except BaseException:
            self.graph = None                  # a fault or an interrupt: capture afresh next time
            raise
        finally:
            stream.synchronize()               # nothing in flight once generate returns
            torch.cuda.current_stream(self.exe.device).wait_stream(stream)
        return ran, replays


def chunk_order(n_chunks: int, depth: int) -> list[tuple[str, int]]:
    """The order of ("enqueue", j) and ("take", j) for chunks 0..n-1 with up to `depth` chunks
    in flight beyond the one being read (1: the next replay runs while the host reads the last
    one; 0: each chunk is read before the next starts). Every chunk is taken, the last too."""
    order, pending = [], []
    for j in range(n_chunks):
        order.append(("enqueue", j))
        pending.append(j)
        while len(pending) > (0 if j == n_chunks - 1 else depth):
            order.append(("take", pending.pop(0)))
    return order


def device_loop(step, args, sampler, token0, steps: int, eos: int | None, keep_logits: bool,
                cache: dict | None = None):
    """A DeviceLoop for the jitted decode step on these args when it runs on the cuda backend
    (a CudaProgram with token and pos inputs); None: use the per-step loop. cache: where the
    last loop is kept between calls (one at a time), reused when program, batch, sync_every,
    eos, keep_logits and the sampling filters match."""
    params, token, pos, kv = args
    if token.device.type != "cuda":
        return None
    from amk.backends.cuda.runtime import CudaProgram
    exe, bindings = step.executable(params, token, pos, kv)
    if not isinstance(exe, CudaProgram) or len(exe.program.outputs) < 2:
        return None
    try:
        exe.input_buffer("token"), exe.input_buffer("pos")
    except KeyError:
        return None
    key = (token0.numel(), steps, eos, keep_logits, sampler.filters)
    kept = (cache or {}).get(key)
    if kept is not None and kept.exe is exe:
        kept.restart(bindings, sampler, token0)
        return kept
    shapes = [tuple(v.aval.shape) for v in step.lower(params, token, pos, kv).graph.outputs]
    loop = DeviceLoop(exe, bindings, shapes, sampler, token0, steps, eos, keep_logits)
    if cache is not None:
        cache.clear()
        cache[key] = loop
    return loop
