"""The one vocabulary of omni-rollout. Every stage imports its types from here."""
from contract.artifacts import (ArtifactSpec, IOSpec, MediaArtifact, collect_artifacts,
                                validate_artifact)
from contract.conditions import Condition, TokenIds
from contract.enums import (DECODED_LAYOUT, Algorithm, GuidanceKind, Layout, MediaRole, Modality,
                            PolicyKind, Representation, SamplerKind, ScoreStatus, StopReason, Task,
                            TimeConvention)
from contract.errors import (ConfigError, ConflictingInputError, DatasetError,
                             DuplicateInputError,
                             InvalidRequestError, LimitExceededError, LoRAMapError,
                             MediaFormatError, MissingArtifactError, NonFiniteError,
                             NonFiniteOutputError,
                             OutputContractError, PolicyVersionError, QueueFullError,
                             ReplicaFailedError, RequestCancelledError, RolloutError,
                             ScorerFailedError, StageUnavailableError, StartupCheckError,
                             UndeclaredArtifactError,
                             UnexpectedArtifactError, UnscorableInputError,
                             MalformedBodyError)
from contract.transport import (ArtifactHandle, ConditionHandle, ConditionSignature,
                                GraphResult, PackedTensors, StageOutput)
from contract.outputs import RewardReport, RolloutOutput, RolloutTree, ScorerOutput, Trajectory
from contract.request import (ORDERED_MEDIA, BranchSpec, MediaInput, PromptBundle, RequestLimits,
                              RolloutRequest, SamplingSpec, check_branch, check_limits,
                              check_requested_artifacts, normalize_media)

__all__ = [name for name in dir() if not name.startswith("_")]
