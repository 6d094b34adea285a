"""Models built on the public graph API: a BERT encoder (SentenceEncoder for
sentence-transformers folders), a Llama decoder (LlamaForCausalLM) and its mixture-of-experts
kin (MoeForCausalLM: Mixtral, Qwen2-MoE, OLMoE), Mamba (MambaForCausalLM), the Qwen3-Next
hybrid (Qwen3NextForCausalLM), image classifiers (ResNet, ViT: torchvision
names), with their weight loaders (safetensors, GGUF). The loaders need the ``models`` extra (safetensors, gguf, tokenizers)."""
from .bert import (BertConfig, BertModel, BertTrainer, SentenceEncoder, bert_param_shapes,
                   build_bert)
from .llama import (LlamaConfig, LlamaForCausalLM, LlamaTrainer, build_llama,
                    llama_config_from_gguf, llama_param_shapes, rope_tables)
from .mamba import MambaConfig, MambaForCausalLM, build_mamba, mamba_param_shapes
from .moe import MoeForCausalLM, fuse_experts
from .qwen3_next import (Qwen3NextConfig, Qwen3NextForCausalLM, build_qwen3_next,
                         qwen3_next_param_shapes)
from .vision import ResNet, ResNetConfig, ViT, ViTConfig, build_resnet, build_vit
from .weights import GGUFFile, check_params, gguf_tokenizer, load_safetensors, reverse_permute

__all__ = ["BertConfig", "BertModel", "BertTrainer", "SentenceEncoder", "bert_param_shapes", "build_bert",
           "LlamaConfig", "LlamaForCausalLM", "LlamaTrainer", "build_llama", "llama_config_from_gguf",
           "llama_param_shapes", "rope_tables", "MoeForCausalLM", "fuse_experts", "GGUFFile",
           "check_params", "gguf_tokenizer", "load_safetensors", "reverse_permute", "ResNet",
           "ResNetConfig", "ViT", "ViTConfig", "build_resnet", "build_vit", "MambaConfig",
           "MambaForCausalLM", "build_mamba", "mamba_param_shapes", "Qwen3NextConfig",
           "Qwen3NextForCausalLM", "build_qwen3_next", "qwen3_next_param_shapes"]
