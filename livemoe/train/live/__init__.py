"""The LiveAssistant seed's training side: the synthetic livestream world, its rule judge, the
trajectory format, MA-MSFT and SM-GSPO (`python -m train.live`)."""
