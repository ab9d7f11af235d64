"""The models the commands take: timm names, transformers folders and open_clip towers built plain (build,
re-exported here), open_clip's zero-shot towers (open_clip), and the registered timm names with method tags
(timm_names)."""
from .build import (HFFolder, ProcessorTransform, build_base_model, check_finite_parameters, eval_transform,
                    hf_data_config, is_hf_folder, load_hf_model, weights_source)

__all__ = ["HFFolder", "ProcessorTransform", "build_base_model", "check_finite_parameters", "eval_transform",
           "hf_data_config", "is_hf_folder", "load_hf_model", "weights_source"]
