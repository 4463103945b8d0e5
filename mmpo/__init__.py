"""mmpo: policy optimization for multimodal and diffusion models.

One shared core (``mmpo.core``) turns (log-prob, old log-prob, advantage, mask)
tensors into a loss; vision-language reasoners (``mmpo.algos``), masked-diffusion
LMs (``dllm``) and diffusion robot policies (``robotics``) all plug into it.
"""

__version__ = "0.1.0"
