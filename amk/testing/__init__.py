"""Test support shared by AMK's own suites (tests/property, tests/gpu): Hypothesis strategies for
random decode steps and pass options, and helpers that run them on the reference VM. Importing
this package needs `hypothesis` (a test dependency), nothing else."""
from amk.testing.strategies import (BLOCKS, Block, Case, Dims, LinearSpec, Plan, bindings,
                                    build_case, decode_steps, dims, fusable_chains,
                                    interpret_case, outputs_differ, pass_options, plans, run_vm,
                                    tolerance, trace_case)

__all__ = ["BLOCKS", "Block", "Case", "Dims", "LinearSpec", "Plan", "bindings", "build_case",
           "decode_steps", "dims", "fusable_chains", "interpret_case", "outputs_differ",
           "pass_options", "plans", "run_vm", "tolerance", "trace_case"]
