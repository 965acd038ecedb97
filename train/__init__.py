"""train/: the Hydra + Lightning job that trains a draft head on a frozen target and measures its acceptance α.

``main.py`` is the entry point (a plain ``run(cfg)`` with ``@hydra.main`` around it), ``data.py`` turns files into
masked token sequences, ``distill.py`` lets the target answer prompts itself, ``module.py`` is the LightningModule,
``acceptance.py`` measures α on held-out data.
"""

from heads.errors import UserError  # noqa: F401  (train's modules raise it as ``from train import UserError``)
