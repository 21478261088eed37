"""Every exception and warning that gossip-train raises on purpose, in one hierarchy.

Every error names what went wrong and where: the rank that raises it, the peer(s) involved, the operation and,
where one exists, the step. The table of failure cases and their messages is docs/failures.md; docs/errors.md
lists every class below with what to do about it.

Every error derives from :class:`GossipError` (itself a ``RuntimeError``), and from exactly one *group*, chosen by
what the user does about it:

.. code-block:: text

    GossipError (RuntimeError)
    |-- ConfigurationError    fix the settings, the launch or the environment, then start again
    |     InvalidArgumentError (also ValueError), LaunchError, BackendUnavailableError, ConfigError (also ValueError),
    |     DDPBackendError (also ValueError), CheckpointWriteError
    |-- PeerFailureError      a peer (its process, its network or its numbers) failed: find the failing rank
    |     PeerFailedError, CommTimeoutError (also TimeoutError), NonFiniteError
    |-- RankMismatchError     the ranks disagree: run the same code, settings and checkpoint on every rank
    |     ReplicaMismatchError (also ValueError), ExchangeMismatchError,
    |     CheckpointMismatchError (also ValueError)
    `-- MisuseError           the calling code breaks the API's contract: change the code
          ArgumentTypeError (also TypeError), ModelChangedError, StepPhaseError, UntrustedCheckpointError,
          UseAfterCloseError

:class:`CheckpointError` is no group but a topic: the checkpoint errors (``CheckpointWriteError``,
``CheckpointMismatchError``, ``UntrustedCheckpointError``) derive from it as well as from their group, so
``except CheckpointError`` catches every checkpoint problem. It is never raised itself.

Classes that derived from a builtin exception before this hierarchy keep it (``except ValueError`` and ``except
TimeoutError`` still catch them). The warnings derive from :class:`GossipWarning` and keep their builtin category
(``UserWarning`` or ``RuntimeWarning``).

:mod:`topologies` (``ScheduleError``) and :mod:`optim` are lower layers that never import ``gossip``; they keep
their own errors. The modules that defined these classes before (``gossip.wrapper.replicas``,
``gossip.wrapper.step_phase``, ``gossip.wrapper.parallel``, ``gossip.checkpoint``, ``gossip.app.train``,
``gossip.app.ddp_baseline``) re-export them.
"""

from __future__ import annotations


class GossipError(RuntimeError):
    """Base class of every error gossip-train raises on purpose; each one also derives from one group below."""


# -- the groups: what the user does about it -------------------------------------------------------------------
class ConfigurationError(GossipError):
    """The run's settings, launch or environment cannot work: fix them, then start the run again.

    An option, an environment variable, a missing package or device, a full disk; the message names the setting.
    """


class PeerFailureError(GossipError):
    """A peer failed while this rank depended on it: find the failing rank and restart from the last checkpoint.

    Its process died, its network stopped answering or its replica diverged; the message names the rank.
    """


class RankMismatchError(GossipError):
    """The ranks disagree: run the same code, the same settings and one checkpoint's files on every rank.

    Model, schedule, algorithm, settings, step or checkpoint; the message names the rank that differs and the item.
    """


class MisuseError(GossipError):
    """The calling code breaks the API's contract: change the code as the message says.

    A call out of order, a model changed after wrapping, an object used after close. Retrying the same call fails
    the same way.
    """


# -- the topic base of the checkpoint errors -------------------------------------------------------------------
class CheckpointError(GossipError):
    """Base class of the checkpoint errors (:mod:`gossip.checkpoint`); the message names the rank and the file.

    A topic, not a group: every subclass also derives from the group that says what to do."""


# -- configuration ---------------------------------------------------------------------------------------------
class LaunchError(ConfigurationError):
    """The launcher environment is inconsistent (e.g. RANK without WORLD_SIZE, rank >= size)."""


class BackendUnavailableError(ConfigurationError):
    """A requested backend cannot run in this process; the message names the fix."""


class InvalidArgumentError(ConfigurationError, ValueError):
    """An argument or setting passed to the library has a value it cannot use.

    A rank below 1, a negative timeout, an unknown policy name, a missing data file, ...; the message names the
    argument, the value and what is accepted.
    """


class ShardedLayoutError(ConfigurationError, ValueError):
    """Sharded replicas (FSDP2 groups gossiping lane by lane) laid out in a way gossip cannot mix correctly.

    DTensor parameters given to the unsharded wrapper, a 2-D FSDP mesh (HSDP), FSDP1's flat shards, a mesh without
    the ``("replicate", "shard")`` dimensions, or lanes that disagree on the schedule or settings; the message
    names the rank, the lane, the parameter and what to do.
    """


class ConfigError(ConfigurationError, ValueError):
    """A ``gossip-train`` command-line option has a value this run cannot use.

    Args:
        option: the option at fault (e.g. ``--schedule``), kept as ``.option``.
        message: what is wrong with its value.
    """

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


class DDPBackendError(ConfigurationError, ValueError):
    """The communicator has no torch.distributed process group for DDP (e.g. the MPI backend)."""


class CheckpointWriteError(CheckpointError, ConfigurationError):
    """A checkpoint could not be written (disk full, quota, permission, ...).

    The message names the rank that failed, its file, the cause and what to do. Every rank raises it; no rank
    replaced its previous checkpoint.
    """


# -- peer failure ----------------------------------------------------------------------------------------------
class PeerFailedError(PeerFailureError):
    """A peer closed its connection or failed; the message names the peer."""


class CommTimeoutError(PeerFailureError, TimeoutError):
    """A wait expired; the message names this rank, the missing peer(s) and the operation."""


class MembershipError(PeerFailureError):
    """Elastic training could not agree on a new member set in time, or this rank was left out of it (it was
    declared dead while alive, or the store holding the membership is gone); the message names the epoch, the
    members and what to do."""


class MembershipChangedError(PeerFailureError):
    """Elastic training: an exchange or collective was interrupted, or not posted, because the member set is
    changing; the elastic controller (:mod:`gossip.wrapper.elastic_run`) catches it and re-forms the group."""


class NonFiniteError(PeerFailureError):
    """A replica's numbers became NaN or Inf; the message names the rank, the peer (if any) and the step.

    A peer sent NaN or Inf (``nonfinite="raise"``), or the main job's training loss on this rank is not finite.
    """


# -- rank mismatch ---------------------------------------------------------------------------------------------
class ReplicaMismatchError(RankMismatchError, ValueError):
    """Ranks disagree on the model, the schedule or the algorithm; the message names the rank and the item."""


class ExchangeMismatchError(RankMismatchError):
    """A peer sent something other than what this rank expected (dtype, size, count or sequence number)."""


class CheckpointMismatchError(CheckpointError, RankMismatchError, ValueError):
    """The checkpoint does not belong to this run (or is missing); the message says what differs on which rank."""


# -- misuse ----------------------------------------------------------------------------------------------------
class ModelChangedError(MisuseError):
    """The wrapped model's parameters changed after wrapping (rebound, replaced, added, frozen or unfrozen).

    The wrapper would no longer mix what the optimizer trains; the message names the rank, step and parameter.
    """


class StepPhaseError(MisuseError):
    """An operation out of order within a training step (e.g. ``next_step()`` before ``finish_mixing()``)."""


class ArgumentTypeError(MisuseError, TypeError):
    """An argument of a type the call cannot take; the message names the argument and the type expected.

    E.g. a tensor that is not contiguous, an object without ``state_dict()``, a wrapper inside a wrapper.
    """


class ElasticUnsupportedError(ConfigurationError):
    """``elastic`` was asked for where it cannot work: the MPI backend (an MPI communicator cannot shrink without
    ULFM), gradient tracking, or a launch without a membership store; the message names the fix."""


class UseAfterCloseError(MisuseError):
    """A communicator or a wrapper was used after ``close()``, or a communicator after an earlier failure.

    The message names the rank and the operation refused (and quotes that failure, the one to act on).
    """


class UntrustedCheckpointError(CheckpointError, MisuseError):
    """A checkpoint holds (or would hold) objects that a weights-only load refuses: it would run pickled code.

    The message names the rank, the file and the object; ``trusted=True`` loads it, only for a file you wrote.
    """


#: The groups: every error class except these, :class:`GossipError` and the topic bases derives from exactly one.
GROUPS: tuple[type[GossipError], ...] = (ConfigurationError, PeerFailureError, RankMismatchError, MisuseError)
#: Bases that collect errors by subject, across groups; never raised themselves.
TOPICS: tuple[type[GossipError], ...] = (CheckpointError,)


# -- warnings --------------------------------------------------------------------------------------------------
class GossipWarning(Warning):
    """Base class of every warning gossip-train emits; each one also keeps its builtin category."""


class NonFiniteWarning(GossipWarning, RuntimeWarning):
    """A peer's non-finite contribution was dropped (``nonfinite="drop"``); the message names the peer and step."""


class AverageDriftWarning(GossipWarning, UserWarning):
    """The schedule is not doubly stochastic, so gossip does not preserve the average of the replicas."""


class MixingOnlyStepWarning(GossipWarning, UserWarning):
    """An optimizer step with no forward or backward since the previous one: it only mixes.

    On one rank only it puts that rank a step ahead of its peers.
    """


class ProcessGroupLeakWarning(GossipWarning, RuntimeWarning):
    """Something still references the torch.distributed process group after ``comm.close()`` destroyed it.

    Its threads then live until interpreter exit, where they can abort the process; the message names the backend.
    """


class CudaGraphWarning(GossipWarning, RuntimeWarning):
    """A kernel sequence could not be captured as a CUDA graph and runs op by op (same results, more launches)."""
