"""A random-init Llama at a real model's shape, saved in the transformers layout with a byte-level BPE tokenizer
padded to the shape's vocabulary: what `cpuforge compress --pretrained hf:DIR`, `cpuforge export` and
`cpuforge quantize` take, for measuring speed and memory at real size without a download (its bits per byte
mean nothing).

    python benchmarks/make_hf_llama.py smollm2-135m /tmp/smol135      # 134.5M: 30 x 576, vocabulary 49,152, tied
    python benchmarks/make_hf_llama.py tinyllama-1.1b /tmp/tiny1b     # 1.10B: 22 x 2048, vocabulary 32,000
    python benchmarks/make_hf_llama.py tinyllama-1.1b /tmp/m571 --layers 10   # fewer layers, the same widths
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                           tie_word_embeddings=False),
}


def tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE learnt from cpuforge's README, padded with added tokens to `vocab_size` ids."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([(ROOT / "README.md").read_text()] * 3, trainers.BpeTrainer(
        vocab_size=4000, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_tokens([f"<extra_{i}>" for i in range(vocab_size - bpe.get_vocab_size())])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, help="layers (default: the shape's)")
    args = parser.parse_args()
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    tok = tokenizer(shape["vocab_size"])
    cfg = transformers.LlamaConfig(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
