"""Engines beyond the toy policy: adapters of real model architectures (optional extras).

``hf_moe``: tiny Hugging Face MoE causal LMs (needs the ``hf`` extra, transformers).
"""
