"""Triton kernels for batched multi-LoRA over the arena's pages, with a torch reference.

Empty in this version: the kernels arrive with the multi-LoRA work (DESIGN.md section 6).
"""
