"""A discrete-event simulator of RolloutPipe's RL step, driven by the project's own scheduling code.

What is real and what is modelled:

    real (imported, not copied)                      modelled (sim/models.py), on a virtual clock
    ----------------------------------------------   ------------------------------------------------
    schedule.RolloutSchedule: admission of groups,   engines: decode time per iteration from the running
      dynamic filtering, replacements, placement       batch and its context, prefill, concurrency, or
      in training batches (slots.StepSlots)            SGLang's scheduler (sim/sglang.py: KV-pool admission,
                                                       priority, preemption, retraction, radix cache)
                                                     response lengths: log-normal, geometric or a histogram
    admission.Admission and its FIFO / FGD policies  rewards: a pass rate per prompt (Beta distributed)
    groups.GroupAssembler + advantages               reward latency, publish latency, weight sync
    dispatcher.Release: sync vs cgp release          trainer: time per micro-batch from its padded tokens,
    batching.BatchConsumer: micro-batches, optimizer   optimizer step
      steps, the rank split
    metrics.reduce_step: the per-step metrics        episodes (multi-turn): turns per episode, environment
    Admission.add_turn: an episode's next turn         replies (tokens) and latency on a pool of workers

``sim/run.py`` strings them together the way pipeline.py does; ``tools/simulate.py`` sweeps settings.
``sim/speculative.py`` models speculative next-step rollout (drafts in idle engines, verified under the new policy).
``sim/compiled.py`` compiles the hot files (these modules and the simulator's own) with mypyc, unchanged.

May import: rolloutpipe, types, model, config, control/, observe/, rollout/, trainer/. Not launch/ or
pipeline.py: it drives the scheduling code the way pipeline.py does.
"""
