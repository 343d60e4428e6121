"""GT's `gt.config`: signal configurations from YAML or Python."""

from paratrain.frontend.client.config import Config, ShardConfig, SignalConfig  # noqa: F401
from paratrain.frontend.client.signal import (  # noqa: F401
    get_config, get_signal_config, load_config, register_config,
)
