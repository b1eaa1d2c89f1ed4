"""The names of the red-team drill's cheating modes: one list for the drill's workers
(`node/worker/red_team.py`), the configs that name them and the simulator's cheaters.
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
