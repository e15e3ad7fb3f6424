// placeholder: replaced by the agent's issue
