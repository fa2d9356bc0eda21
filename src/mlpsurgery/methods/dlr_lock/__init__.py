"""DLR-Lock: lock a pretrained model against fine-tuning (papers/dlr-lock.txt, SPEC §1).

Every MLP residual sub-block `x -> x + MLP(Norm(x))` is replaced by a deep low-rank residual network
(modules/dlr.py) distilled to compute the same function, so inference is unchanged while a training step
must store activations for every one of the DLR-Net's blocks.

    Phase 1 (module-wise): capture (x, y) of every sub-block on calibration text (capture.py, on disk,
      resumable); train all layers' DLR-Nets side by side as one batched network (StackedDLR) on the
      relative MSE  sum ||DLR(x) - y||^2 / sum ||y - x||^2  (1.0 = no better than identity), AdamW, cosine
      with 5% warm-up, gradient norm clipped to 1.0 *per layer* (so batching changes nothing: AdamW is
      element-wise and each layer's loss touches only its own parameters).
    Phase 2 (logits): with every MLP replaced, train only the DLR-Net parameters so that the student's
      next-token distribution matches the original's: top-k KL with the teacher's top-k tokens and one
      bucket for the rest of the mass (a k+1-way KL: unlike a sum restricted to the top-k alone, its optimum
      does not push the student's tail mass to zero). Teacher targets are computed once before the
      surgery and stored. Encoders without an LM head distil the final hidden states (relative MSE).

Files: config (settings, report, plan), captured (the captured pairs and their sampling), start (the closed-form
start of phase 1), losses, modulewise (phase 1), logits (phase 2), workdir (resumable stages), lock (the whole lock,
and phase 2 alone on a locked model), layerwise (phase 1 one decoder layer at a time from the checkpoint's files),
cost (what a locked model costs), attacks (the adaptive attacker).

Everything intermediate lives in a work folder (capture, checkpoints, teacher targets): a killed run
resumes where it stopped and nothing finished is recomputed.
"""

from .attacks import (AttackSuiteConfig, ReversedSubblock, ReverseResult, adaptation_costs, attack_suite, attack_table,
                      install_reversed, plot_adaptation, plot_attack_suite, reverse_distill)
from .captured import capture_batch, split_chunks
from .config import PHASE1_LOSSES, PHASE1_STARTS, DLRConfig, DLRReport, plan, rank_for_depth
from .cost import activation_memory_model, inference_times, locked_like
from .lock import continue_phase2, dlr_lock, install, module_errors
from .logits import dlr_parameters, phase2, teacher_targets
from .losses import relative_error, token_relative_error, topk_kl
from .modulewise import phase1

__all__ = ["AttackSuiteConfig", "DLRConfig", "DLRReport", "PHASE1_LOSSES", "PHASE1_STARTS", "ReverseResult",
           "ReversedSubblock",
           "activation_memory_model", "adaptation_costs", "attack_suite", "attack_table", "capture_batch", "continue_phase2",
           "dlr_lock",
           "dlr_parameters", "inference_times", "install", "install_reversed", "locked_like", "module_errors", "phase1", "phase2", "plan",
           "plot_adaptation", "plot_attack_suite", "rank_for_depth", "relative_error", "reverse_distill", "split_chunks", "teacher_targets",
           "token_relative_error", "topk_kl"]
