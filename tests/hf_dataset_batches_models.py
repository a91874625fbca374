"""Models and input pipelines of ``test_hf_dataset_batches``: a Hugging Face ``datasets.Dataset``
built in memory (``Dataset.from_dict``, nothing downloaded), tokenized by a word-level tokenizer
made in memory, ``set_format("torch")``, batched by ``DataCollatorWithPadding`` (a
``BatchEncoding``, no dict) or by a hand collate holding WebDataset-style string keys beside the
tensors. The bag-of-embeddings classifier's masked mean divides by each row's token count, 0 for
an empty text."""

from __future__ import annotations

import numpy as np
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

N, WORDS, D, CLASSES, BATCH = 32, 20, 8, 3, 8


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")


def texts(empty: int | None = None) -> Dataset:
    """N texts of 2 to 6 words with labels and their ``idx``; record ``empty`` has no word."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(N):
        n = 0 if i == empty else int(torch.randint(2, 7, (1,), generator=g))
        rows.append(" ".join(f"w{int(t)}" for t in torch.randint(0, WORDS, (n,), generator=g)))
    labels = torch.randint(0, CLASSES, (N,), generator=g).tolist()
    return Dataset.from_dict({"text": rows, "label": labels, "idx": list(range(N))})


def padded_loader(data: Dataset, seed: int = 1) -> DataLoader:
    """Tokenized, ``set_format("torch")``, shuffled, padded by ``DataCollatorWithPadding``."""
    tok = tokenizer()
    ds = data.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    ds = ds.rename_column("label", "labels")
    ds.set_format("torch")
    return DataLoader(ds, batch_size=BATCH, shuffle=True, collate_fn=DataCollatorWithPadding(tok),
                      generator=torch.Generator().manual_seed(seed))


def features(bad: int | None = None) -> Dataset:
    """N records of 4 float features, ``.with_format("torch")``; record ``bad`` holds an inf."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(N, 4, generator=g)
    if bad is not None:
        x[bad, 1] = float("inf")
    return Dataset.from_dict({"x": x.tolist(), "y": torch.randint(0, CLASSES, (N,), generator=g),
                              "__key__": [f"shard-0/{i:05d}" for i in range(N)]}
                             ).with_format("torch", columns=["x", "y"], output_all_columns=True)


def keyed_collate(items: list[dict]) -> dict:
    """The tensors, the records' string keys, their row numbers as a NumPy array and as a list
    of NumPy integers (as a pandas index gives them), and the batch's size."""
    rows = [np.int64(int(r["__key__"].rpartition("/")[2])) for r in items]
    return {"x": torch.stack([r["x"] for r in items]), "y": torch.stack([r["y"] for r in items]),
            "__key__": [r["__key__"] for r in items], "row_id": np.array(rows),
            "example_id": rows, "n": len(items)}


def keyed_loader(data: Dataset, seed: int = 1) -> DataLoader:
    return DataLoader(data, batch_size=BATCH, shuffle=True, collate_fn=keyed_collate,
                      generator=torch.Generator().manual_seed(seed))


class Bag(nn.Module):
    """Mean of the embeddings of each row's tokens, then a linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(WORDS + 2, D, padding_idx=0)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, input_ids, attention_mask, **unused):
        m = attention_mask.unsqueeze(-1).to(self.emb.weight.dtype)
        return self.head((self.emb(input_ids) * m).sum(1) / m.sum(1))  # 0/0: an empty text


class WholeBag(nn.Module):
    """The classifier given the collator's ``BatchEncoding`` whole."""

    def __init__(self):
        super().__init__()
        self.bag = Bag()

    def forward(self, batch):
        return self.bag(batch["input_ids"], batch["attention_mask"])


class Tabular(nn.Module):
    """A small MLP given the collated dict whole."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, CLASSES))

    def forward(self, batch):
        return self.net(batch["x"])


def make_bag() -> Bag:
    torch.manual_seed(0)
    return Bag()


def make_whole_bag() -> WholeBag:
    torch.manual_seed(0)
    return WholeBag()


def make_tabular() -> Tabular:
    torch.manual_seed(0)
    return Tabular()
