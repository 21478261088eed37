"""The communicator layer: the :class:`~gossip.backends.base.Communicator` interface and its backends (``simulator``,
``torch_dist``, ``mpi``), and the process bootstrap that starts one (``bootstrap``: ``gossip.init``; ``launch_env``:
reading the launcher's environment; ``rendezvous``: the checked store of a job started without torchrun's agent).
This layer imports only ``gossip.errors`` and the topologies; the public names live on ``gossip``.
"""
