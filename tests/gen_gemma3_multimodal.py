"""Write tests/data/tiny-gemma3-mm: a tiny random Gemma3ForConditionalGeneration saved by
transformers, so the multimodal checkpoint layout (decoder layers under
`model.language_model.layers.N`, a vision tower with layers of its own, the text settings under
`text_config`) is the one transformers writes.

Run with a Python that has torch and transformers:

    .cache/qwen2-venv/bin/python tests/gen_gemma3_multimodal.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

OUT = Path(__file__).resolve().parent / "data" / "tiny-gemma3-mm"


def main() -> None:
    cfg = Gemma3Config(
        text_config={
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        },
        mm_tokens_per_image=4,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16)
    model.save_pretrained(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
