"""The family registry's old path: the registry is ``megatrain_jax/families.py`` (config validation
needs it without importing the models)."""
from megatrain_jax.families import (DEFAULT_FAMILY, FAMILY_MODULES, Family, architecture_of,  # noqa: F401
                                    families, family_names, family_of_architecture, get_family, register,
                                    supported_architectures)
