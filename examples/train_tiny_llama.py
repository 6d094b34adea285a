"""Train a small Llama-architecture language model on a text file, byte by byte, on the GPU.

    python examples/train_tiny_llama.py                       # the repository's README.md
    python examples/train_tiny_llama.py --text book.txt --steps 1000 --hidden 256 --layers 6
    python examples/train_tiny_llama.py --help

Tokens are the text's UTF-8 bytes (vocabulary 256: no tokenizer needed). The model is a
LlamaForCausalLM with random weights (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied
embeddings); ``model.trainer(batch, seq, rlx.optim.AdamW(...), clip_grad_norm=1.0)`` compiles
forward + backward + AdamW update as one executable (one CUDA graph a step on a GPU). A progress
bar (tqdm when installed, else a line every 5% of the steps) shows the loss; the loss curve is
saved to --out (loss.png; needs matplotlib); then a short sample is generated with
``model.generate`` and decoded as bytes. ``rlx-numba demo --train`` runs the same code.

Under the numba CUDA simulator (no GPU) the defaults drop to a very small model and a few steps,
and it says so: there every CUDA thread is an OS thread.

The code lives in rlx_numba/models/tiny_lm.py (so the CLI can import it): ``train_tiny_llama``
is the training loop, ``main`` the arguments, progress bar, plot and sample.
"""
import os
import sys

try:
    from rlx_numba.models.tiny_lm import main
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from rlx_numba.models.tiny_lm import main

if __name__ == "__main__":
    sys.exit(main())
