"""`integrations/`: oneiter inside other training frameworks (mmengine hooks; Hugging Face Trainer callback)."""
