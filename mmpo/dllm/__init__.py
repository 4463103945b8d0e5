"""Masked-diffusion LMs (LLaDA-style): sampler, log-prob estimator, SFT, diffu-GRPO and IGPO.

Modules (one job each): ``task`` (synthetic arithmetic with reference traces), ``rewards``
(correctness), ``tokenizer`` (local character tokenizer), ``modeling`` (tiny / real mask
predictors, save and load), ``sampler`` (LLaDA block sampler with fixed hint positions),
``logprobs`` (one-pass estimator), ``hints`` and ``igpo`` (IGPO, arXiv 2509.10396), ``sft``
and ``rl`` (Lightning modules), ``data`` (data modules), ``eval`` (``mmpo eval`` support),
``warmup`` (create the SFT checkpoint RL starts from). See docs/dllm.md.
"""
