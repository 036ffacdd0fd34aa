"""Agent sessions: who a request belongs to, how its turn ended, when it is expected back."""
