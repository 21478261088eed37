"""Gossip inside the training frameworks people already use: PyTorch Lightning, the HuggingFace Trainer, Accelerate.

* :mod:`gossip.integrations.lightning` -- ``GossipStrategy``, a Lightning strategy: ``Trainer(strategy=
  GossipStrategy(), accelerator=..., devices=N)`` (needs ``pip install 'gossip-train[lightning]'``).
* :mod:`gossip.integrations.hf` -- ``GossipTrainer``, a ``transformers.Trainer`` whose model is the gossip wrapper
  instead of Accelerate's DDP (``pip install 'gossip-train[hf]'``).
* Accelerate custom loops need no code: prepare the dataloaders and the optimizer, not the model
  (docs/guide/huggingface.md).

Neither framework is imported by ``import gossip`` nor by this package: import the submodule you use.
:mod:`gossip.integrations.common` holds what both share (the communicator on a process group of its own, the
choice of wrapper).
"""
