"""Pipeline parallelism: stages on disjoint device groups, run by an actor runtime.

OneFlow's runtime (paper section 4): every operation is an actor; actors
exchange ``req``/``ack`` messages about registers whose fixed slot counts give
flow control, so pipelining and back-pressure follow without a central
scheduler. GPipe and 1F1B are register counts; interleaved 1F1B and the
zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, DualPipeV) are explicit action
lists, validated before they run. Each stage's backward comes from one VJP and
splits into B (input cotangent) and W (weight cotangent) for the zero-bubble
schedules. The same actor graph runs for real (one thread per device group,
FIFO queues) or on a simulated clock.

    import sbpjax.pipeline as sjp
    pipe = sjp.Pipeline([sjp.Stage(fn_i, params_i, pl_i) for ...], loss_fn, optax.sgd(0.1),
                        microbatches=8, schedule="1f1b")
    result = pipe.step(x, y)
    result.timeline.gantt("timeline.png")
    c = sjp.cut(nnx_model, sj.placement((4, 2), ("pp", "tp")), axis="pp", sample=tokens)  # stages from the model
    pipe = sjp.Pipeline(c.stages, loss_fn, optax.sgd(0.1), microbatches=8)
    sjp.simulate("zb-h1", devices=4, microbatches=8,
                 durations={"forward": 1, "backward_input": 1, "backward_weight": 1}).makespan
"""

from sbpjax.pipeline.actor import ActorGraph, ActorSpec
from sbpjax.pipeline.balance import Balance, balance
from sbpjax.pipeline.chain import Layer, LayerChain
from sbpjax.pipeline.cut import Cut, cut, layer_costs, layer_flops, layer_times
from sbpjax.pipeline.errors import PipelineError, PipelineStall, PipelineTimeout
from sbpjax.pipeline.graph import build_graph
from sbpjax.pipeline.pipeline import Pipeline, StepResult
from sbpjax.pipeline.register import RegisterSpec
from sbpjax.pipeline.registry import SCHEDULES, as_schedule
from sbpjax.pipeline.runtime import ThreadedSystem
from sbpjax.pipeline.schedule import (
    ActionList,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    megatron_interleaved,
)
from sbpjax.pipeline.simulate import simulate, simulate_graph
from sbpjax.pipeline.split import SplitVJP, split_vjp
from sbpjax.pipeline.stage import Stage
from sbpjax.pipeline.timeline import ActionRecord, RegisterStats, Timeline
from sbpjax.pipeline.validate import validate_action_lists
from sbpjax.pipeline.zero_bubble import DualPipeV, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV

__all__ = [
    "Pipeline",
    "Stage",
    "StepResult",
    "Schedule",
    "GPipe",
    "OneFOneB",
    "Interleaved1F1B",
    "ActionList",
    "megatron_interleaved",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "DualPipeV",
    "SCHEDULES",
    "as_schedule",
    "validate_action_lists",
    "split_vjp",
    "SplitVJP",
    "simulate",
    "simulate_graph",
    "build_graph",
    "Timeline",
    "ActionRecord",
    "RegisterStats",
    "ActorGraph",
    "ActorSpec",
    "RegisterSpec",
    "ThreadedSystem",
    "LayerChain",
    "Layer",
    "balance",
    "Balance",
    "cut",
    "Cut",
    "layer_costs",
    "layer_flops",
    "layer_times",
    "PipelineError",
    "PipelineStall",
    "PipelineTimeout",
]
