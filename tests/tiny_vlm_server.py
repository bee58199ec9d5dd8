"""An OpenAI-compatible /v1/chat/completions server answering with a real tiny VLM (LLaVA:
CLIP vision tower + Llama, random weights, character-level tokenizer built locally).

It reads image_url data URLs and text parts as vLLM does, runs the model on them and answers
with what the model generates: greedy decoding, or -- with `structured_outputs: {"choice": [..]}`
(or `guided_choice`) -- the choice the model gives the highest log-likelihood, which is what
constrained decoding returns for single-token-per-character choices under greedy search."""
from __future__ import annotations

import base64
import io

import numpy as np
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'\"-/()")


def build_tiny_llava(seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor,
                              PreTrainedTokenizerFast)

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                                pad_token_id=0),
        image_token_index=vocab["<image>"], vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(cfg).eval()
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}), tokenizer=tok,
        patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return model, proc


class TinyVLMServer:
    def __init__(self, model_name: str = "tiny-llava"):
        self.model_name = model_name
        self.model, self.proc = build_tiny_llava()
        self.exchanges: list[tuple[dict, str]] = []      # (request body, its answer), answered
        self.requests: list[dict] = []

    def complete(self, body: dict) -> str:
        images, texts = [], []
        for msg in body["messages"]:
            content = msg["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    texts.append(part["text"])
                elif part["type"] == "image_url":
                    url = part["image_url"]["url"]
                    if not url.startswith("data:image/png;base64,"):
                        raise ValueError("only PNG data URLs are served here")
                    from PIL import Image
                    raw = base64.b64decode(url.split(",", 1)[1])
                    images.append(np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")))
        text = "<image>" * len(images) + "\n" + "\n".join(texts) + "\nAnswer: "
        inputs = self.proc(images=images or None, text=[text], return_tensors="pt")
        choices = (body.get("structured_outputs") or {}).get("choice") or body.get("guided_choice")
        with torch.no_grad():
            if choices:
                return max(choices, key=lambda c: self._loglik(inputs, c))
            out = self.model.generate(**inputs, max_new_tokens=int(body.get("max_tokens", 16)),
                                      do_sample=False)
        return self.proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                          skip_special_tokens=True)

    def _loglik(self, inputs, choice: str) -> float:
        ids = torch.tensor([self.proc.tokenizer(choice, add_special_tokens=False)["input_ids"]])
        full = torch.cat([inputs["input_ids"], ids], 1)
        logits = self.model(input_ids=full, attention_mask=torch.ones_like(full),
                            pixel_values=inputs.get("pixel_values")).logits[0, :-1]
        logp = logits.log_softmax(-1)[-ids.shape[1]:]
        return float(logp.gather(1, ids[0, :, None]).sum())

    def app(self) -> Starlette:
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append(body)
            try:
                answer = self.complete(body)
            except (KeyError, ValueError) as e:
                return JSONResponse({"error": {"message": str(e), "type": "BadRequest"}},
                                    status_code=400)
            self.exchanges.append((body, answer))
            message = {"role": "assistant", "content": answer}
            return JSONResponse({"id": f"chatcmpl-{len(self.exchanges)}",
                                 "object": "chat.completion", "model": self.model_name,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": message}]})
        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
