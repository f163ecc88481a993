"""Run the token-capture loop end to end and print what happened.

Generates GRPO groups of multi-turn rollouts with the toy MoE policy on Dask workers,
stages every call's delta (with its digest) in the staging store, and finalizes each
training step through the finalization graph (one union fetch, verify tasks on
``finalize`` slots, assemble), several steps in flight. Prints per-step accepted /
rejected rollouts by reason, fetch_ms vs verify_ms and tokens/s (training tokens of the
step's accepted rows over the seconds from submitting its graph to its last group
assembled), a store summary and the dashboard address. Uses an embedded LocalCluster on
127.0.0.1 (--dashboard-address, --n-workers) unless --scheduler is given (--connect-timeout).
Step ids are <run-id>-step-<n>, with a short random run id printed first.

Then (unless --no-resume) the checkpoint/resume phase: one more step of rollouts runs on
GenerationWorker actors, is cut mid-generation, the store is checkpointed, the actors
are killed and recreated, the store is restored from its checkpoint into a fresh one,
every in-flight call resumes from its prefix (PrefixReadBatcher), the rollouts finish and
are finalized; prints cut and restore statistics and how many finalized rollouts are
bit-identical to an uninterrupted run of the same seeds.
Also a group tampered with on purpose, rejected by reason (--no-tamper), and a scale
phase printing the adaptive policy's decisions (--no-scale-demo); see the README.
"""
from __future__ import annotations

from .arguments import add_arguments, check_arguments
from .context import DemoRun, DemoSettings, new_run_id
from .reporter import Reporter, describe_decision
from .resume import resume_phase, run_resume
from .runner import PHASES, Phase, main, run, run_phases
from .scale import scale_phase, scaling_since, stage_synthetic
from .steps import keep_alive, run_steps
from .tamper import TAMPER_GROUP, generate_tampered_and_stage, tamper_specs, tamper_step

__all__ = [
    "PHASES",
    "TAMPER_GROUP",
    "DemoRun",
    "DemoSettings",
    "Phase",
    "Reporter",
    "add_arguments",
    "check_arguments",
    "describe_decision",
    "generate_tampered_and_stage",
    "keep_alive",
    "main",
    "new_run_id",
    "resume_phase",
    "run",
    "run_phases",
    "run_resume",
    "run_steps",
    "scale_phase",
    "scaling_since",
    "stage_synthetic",
    "tamper_specs",
    "tamper_step",
]
