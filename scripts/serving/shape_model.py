"""A model folder shaped exactly like Qwen2.5-7B-Instruct (config + a small trained BPE tokenizer with the ChatML
template), for serving with `load_format: dummy` where real weights cannot be downloaded.

Throughput and latency depend on shapes, not weight values; quality does not, so quality on such a folder is
reported as n/a. Adapted from the workplace's qwen7b-shape.py (same config; tokenizer trained on local files).
"""
from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 131072,
             "max_window_layers": 28, "attention_dropout": 0.0}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write(out: Path, awq: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f for root in (sys.base_prefix, sys.prefix, "/usr")
              for f in sorted(glob.glob(f"{root}/lib/python3*/**/*.py", recursive=True))][:400]
    if not corpus:
        raise RuntimeError("no Python sources found to train the shape model's tokenizer on")
    tok.train(corpus, trainers.BpeTrainer(vocab_size=16000,
                                          special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "chat_template": CHATML, "model_max_length": 32768}))
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = dict(QWEN25_7B, bos_token_id=bos, eos_token_id=eos)
    if awq:
        cfg.update(torch_dtype="float16", quantization_config=AWQ)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": bos}))
