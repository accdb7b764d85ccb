"""What the GPU bench tools share: a parser that shows the tool's docstring, the check that a
CUDA GPU is there (else the tool says so and exits 2), and the probes' sweep loop, JSON rows and
%globaltimer arithmetic."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def have_gpu(tool: str) -> bool:
    """True when torch sees a CUDA GPU; else prints which tool needs one (`tool`: its __file__)."""
    import torch
    if torch.cuda.is_available():
        return True
    print(f"bench/{Path(tool).name} needs a CUDA GPU", file=sys.stderr)
    return False


def sweep(configs, run, line, label=str) -> list[dict]:
    """run(cfg) for each config, printing line(result); a config that does not compile or
    launch is reported (label(cfg) and the error) and skipped, not fatal. The results."""
    out = []
    for cfg in configs:
        try:
            r = run(cfg)
        except Exception as e:
            print(f"{label(cfg)} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        out.append(r)
        print(line(r))
    return out


def write_rows(path: str | None, rows: list[dict]) -> None:
    """The sweep's rows as JSON with the device's name (nothing when path is None)."""
    if path:
        import torch
        Path(path).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))


def cta_span_us(t, ctas: int) -> float:
    """Last end - first start (us) of a launch whose CTA b wrote its %globaltimer start and end
    to t[2b], t[2b + 1]."""
    tt = t.view(ctas, 2).double()
    return float((tt[:, 1].max() - tt[:, 0].min()) / 1e3)


def warm_median(xs: list[float]) -> float:
    """The median of repeated measurements, the first (warm-up) left out."""
    rest = sorted(xs[1:])
    return rest[len(rest) // 2]
