"""What fits a GPU: the memory model, the layer split, the planner and its report.

    memory         memory of a Llama-style model per stage and per rank, term by term
    partition      nanotron's layer split and the exact optimal split
    split_problem  the split problem: costs and memory of every split, simulated
    split_search   the branch and bound of the optimal split
    split_relax    its relaxation to real layer counts, by the simplex method
    step_graph     a schedule's step time and critical path under many costs (= simulate's)
    peaks          per-rank peak bytes and in-flight from program order (= simulate's)
    config         what a plan is for (`PlanConfig`, `build_config`), compute costs
    candidate      one evaluated way to run the pipeline; caps that fit a split
    offload        what the planner counts for a rank that streams its stashes to the host
    planner        `plan(config)`: every candidate evaluated, the recommendation
    evaluation     one candidate's memory and step time (schedule_cache, stage_costs)
    splits         the split searches of a plan; alternatives: what it tries; choice: its pick
    report         a plan as text, JSON and a PNG
    presets        model and GPU presets (with host links), model files
"""

from pipeschedule.plan.candidate import Candidate, fitted_caps
from pipeschedule.plan.config import PlanConfig, build_config, head_seconds, layer_seconds
from pipeschedule.plan.planner import Plan, plan

__all__ = ["Candidate", "Plan", "PlanConfig", "build_config", "fitted_caps", "head_seconds", "layer_seconds", "plan"]
