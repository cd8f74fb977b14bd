"""`train.remat_policy` names as `jax.checkpoint` policies: what a block keeps for its backward pass.

GENERIC holds the policies any model takes (the built-in ViT, brought models through
trainer.memory.remat.checkpoint_policy); the Llama adds save-by-name ones for the activations it tags.
"""

import jax

from trainer import attention as attention_lib

GENERIC = {
    'full': None,  # Save nothing: recompute the whole block in the backward pass.
    'dots_saveable': attention_lib.dots_saveable,  # Every matmul output, and a fused attention kernel's.
    # Matmul outputs without a batch dimension: in a transformer block that is almost none
    # (weights are applied to (B, L, ...) activations), so this sits close to 'full'.
    'dots_with_no_batch_dims_saveable': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
