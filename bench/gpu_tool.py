"""What the GPU bench tools share: a parser that shows the tool's docstring, and the check that
a CUDA GPU is there (else the tool says so and exits 2)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parser(doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def have_gpu(tool: str) -> bool:
    """True when torch sees a CUDA GPU; else prints which tool needs one (`tool`: its __file__)."""
    import torch
    if torch.cuda.is_available():
        return True
    root = Path(__file__).resolve().parent.parent
    print(f"{Path(tool).resolve().relative_to(root)} needs a CUDA GPU", file=sys.stderr)
    return False
