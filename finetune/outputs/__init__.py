"""What a run reports: the model card, the Hub, the banner and final figures, FLOPs and the measured peak, the
lm-evaluation-harness glue. Below the lifecycle, which writes them."""
