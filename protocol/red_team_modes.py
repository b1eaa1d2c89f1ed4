"""The names of the red-team drill's cheating modes: one list for the drill's workers
(`node/worker/red_team.py`), the configs that name them and the simulator's cheaters, and one
for the drill's cheating trainers (`node/trainer/red_team.py`: books an audit must catch).
Pure names, no torch: a typo in `--red-team` is reported before anything heavy loads."""

FORGED_SIGNATURE = "forged_signature"
REPLAY = "replay"
INFLATED_REWARD = "inflated_reward"
FABRICATED_LOGPROBS = "fabricated_logprobs"
RANDOM_TOKENS = "random_tokens"
BASE_MODEL_ONLY = "base_model_only"
STALE_VERSION = "stale_version"
PROMPT_SWAP = "prompt_swap"
COPYCAT = "copycat"
NAN_LOGPROBS = "nan_logprobs"
FORGED_ENV_REPLY = "forged_env_reply"
MODES = (FORGED_SIGNATURE, REPLAY, INFLATED_REWARD, FABRICATED_LOGPROBS, RANDOM_TOKENS, BASE_MODEL_ONLY,
         STALE_VERSION, PROMPT_SWAP, COPYCAT, NAN_LOGPROBS, FORGED_ENV_REPLY)

OMIT_GROUPS = "omit_groups"              # a worker's trained groups left out of the statements
SYBIL_CREDIT = "sybil_credit"            # batches never received credited to the trainer's own sybil key
MISSTATED_ADAPTER = "misstated_adapter"  # statements naming another adapter than the version's signed update
TRAINER_MODES = (OMIT_GROUPS, SYBIL_CREDIT, MISSTATED_ADAPTER)
