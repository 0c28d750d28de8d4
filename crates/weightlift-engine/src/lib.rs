//! The device runtime (cpu, virtual, cuda), the loader that carries out a Plan, and Model, Cache and TPContext.
