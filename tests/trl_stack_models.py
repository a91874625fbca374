"""LLM post-training with TRL as its users write it, for ``test_trl_stack``: tiny randomly
initialised causal LMs built from configs (``LlamaForCausalLM``, ``GPT2LMHeadModel``, a
``LlamaForSequenceClassification`` reward model; nothing downloaded), a word-level tokenizer
built with ``tokenizers`` and wrapped as ``PreTrainedTokenizerFast``, and the datasets TRL's
``SFTTrainer`` (prompt / completion), ``DPOTrainer`` and ``RewardTrainer`` (prompt / chosen /
rejected) take, built with ``datasets.Dataset.from_dict``."""

from __future__ import annotations

import random

import torch

WORDS = [f"w{i}" for i in range(90)]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
VOCAB = len(SPECIAL) + len(WORDS)
PAD, EOS, BOS = 0, 1, 2


def make_tokenizer():
    """A word-level tokenizer (whitespace split) with pad / eos / bos tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
                                 attn_implementation="eager"), **kw})


def make_llama():
    """``LlamaForCausalLM`` (the policy SFT and DPO train; the factory the replay rebuilds)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def make_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=64, bos_token_id=BOS, eos_token_id=EOS,
                                      pad_token_id=PAD, attn_implementation="eager"))


def make_reward_model():
    """``LlamaForSequenceClassification`` with one label: the scalar reward."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    return LlamaForSequenceClassification(llama_config(num_labels=1))


RARE = WORDS[-1]  # a word only planted records hold
RARE_ID = VOCAB - 1


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS[:-1]) for _ in range(n))


def sft_data(n: int, empty_at: int | None = None, seed: int = 0):
    """Prompt / completion pairs; record ``empty_at`` has an empty completion."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [_text(rng, rng.randint(3, 6)) for _ in range(n)]
    completions = [" " + _text(rng, rng.randint(2, 5)) for _ in range(n)]
    if empty_at is not None:
        completions[empty_at] = ""
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def preference_data(n: int, rare_at: int | None = None, seed: int = 0):
    """Prompt / chosen / rejected triples (DPO); the chosen completion of record ``rare_at``
    ends on the rare word :data:`RARE`."""
    from datasets import Dataset

    rng = random.Random(seed)
    chosen = [" " + _text(rng, rng.randint(2, 5)) for _ in range(n)]
    if rare_at is not None:
        chosen[rare_at] += " " + RARE
    return Dataset.from_dict({
        "prompt": [_text(rng, rng.randint(3, 6)) for _ in range(n)], "chosen": chosen,
        "rejected": [" " + _text(rng, rng.randint(2, 5)) for _ in range(n)]})


def reward_data(n: int, nan_margin_at: int | None = None, seed: int = 0):
    """Implicit-prompt preference pairs with a ``margin`` column (annotators' score gap);
    record ``nan_margin_at`` has a NaN margin (a missing rating)."""
    from datasets import Dataset

    rng = random.Random(seed)
    margin = [float(rng.randint(0, 3)) for _ in range(n)]
    if nan_margin_at is not None:
        margin[nan_margin_at] = float("nan")
    return Dataset.from_dict({
        "chosen": [_text(rng, rng.randint(4, 8)) for _ in range(n)],
        "rejected": [_text(rng, rng.randint(4, 8)) for _ in range(n)],
        "margin": margin})


def make_fused_llama():
    """``make_llama`` with the fused LM head TRL's trainers patch onto the model they train
    (``trl.trainer.utils.add_fused_lm_head``: ``model(..., fused_lm_head=True)`` returns
    per-token log-probabilities): the factory of a run under ``SFTTrainer`` / ``DPOTrainer``."""
    from trl.trainer.utils import add_fused_lm_head

    model = make_llama()
    add_fused_lm_head(model)
    return model


def make_half_reference(rare_row: float = 1e7):
    """The DPO reference: the policy's initial weights converted to float16 to save memory, as
    ``from_pretrained(..., torch_dtype=torch.float16)`` loads a checkpoint. The rare word's
    embedding row (rarely updated, ``rare_row`` times the others) is beyond float16's largest
    value 65504: the conversion stores it as inf."""
    ref = make_llama()
    with torch.no_grad():
        ref.model.embed_tokens.weight[RARE_ID] *= rare_row
    return ref.half().eval()


def make_fused_gpt2():
    """``make_gpt2`` with TRL's fused LM head (see :func:`make_fused_llama`)."""
    from trl.trainer.utils import add_fused_lm_head

    model = make_gpt2()
    add_fused_lm_head(model)
    return model


def nan_checkpoint_gpt2():
    """A GPT-2 policy loaded from a checkpoint with one NaN in layer 1's MLP input projection
    (a merge of adapters that divided by a zero scale)."""
    model = make_gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 7] = float("nan")
    return model


def loud_head_llama(value: float = 1e38):
    """A Llama policy from a checkpoint whose output embedding row of the rare word holds
    ``value`` everywhere (finite: an untied head row a bad merge overwrote)."""
    model = make_llama()
    with torch.no_grad():
        model.lm_head.weight[RARE_ID] = value
    return model
