"""A character-level tokenizer trained locally on the task corpus (no hub access).

Built with ``tokenizers`` (a BPE model whose pre-tokenizer isolates every character, so
digits are single tokens and arithmetic is learnable digit by digit) and wrapped in
transformers' ``PreTrainedTokenizerFast``, so it saves and loads with
``AutoTokenizer.from_pretrained`` exactly like a real checkpoint's tokenizer.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "[PAD]"
MASK_TOKEN = "[MASK]"
EOS_TOKEN = "[EOS]"
SPECIAL_TOKENS = (PAD_TOKEN, MASK_TOKEN, EOS_TOKEN)


def train_char_tokenizer(texts: list[str], *, vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """Train a character-level tokenizer on ``texts``.

    The special tokens get ids 0 (pad), 1 (mask), 2 (eos); the pad id differs from the mask
    id, as the LLaDA sampler requires.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if not texts:
        raise ValueError("train_char_tokenizer needs a non-empty corpus")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    # Each character is its own pre-token, so BPE cannot merge across characters.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
    )
