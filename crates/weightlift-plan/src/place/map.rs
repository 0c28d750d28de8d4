//! An explicit device map: keys for the default (`""`), layer ranges (`blk.0-11`,
//! `model.layers.3`), the named non-layer tensors, and module prefixes, plus llama.cpp `-ot`
//! style regex overrides that win over the map. Two keys that send one tensor to two devices
//! are a conflict; a tensor no key covers is an error. A layer lives where its attention is.

use regex::Regex;
use weightlift_format::{Role, TensorInfo};

use super::{Assign, Ctx, Dev, UnitKind};
use crate::device::resolve_device;
use crate::error::{PlanError, Result};
use crate::request::DeviceMap;

impl Ctx<'_> {
    /// An explicit device map with `-ot` style regex overrides.
    pub(super) fn map(&self, m: &DeviceMap) -> Result<Assign> {
        if m.entries.is_empty() && m.overrides.is_empty() {
            return Err(PlanError::option(
                "device_map",
                "at least one entry, e.g. {\"\": \"cpu\"} or {\"blk.0-11\": \"cuda:0\"}",
                "an empty map",
            ));
        }
        let resolve = |d: &str| resolve_device_in(&self.devs, d);
        let overrides = self.overrides(&m.overrides)?;
        let mut entries = Vec::with_capacity(m.entries.len());
        let mut default = None;
        for (pat, dev) in &m.entries {
            let d = resolve(dev)?;
            match Matcher::parse(pat) {
                Matcher::Default => default = Some(d),
                mt => entries.push((pat.as_str(), mt, d)),
            }
        }
        let mut a = self.empty_assign();
        let mut missing = Vec::new();
        for (i, t) in self.tensors().iter().enumerate() {
            if let Some((_, d)) = overrides.iter().find(|(re, _)| re.is_match(&t.name)) {
                a.tensor_dev[i] = *d;
                continue;
            }
            let mut hit: Option<(&str, usize)> = None;
            for (pat, mt, d) in &entries {
                if !mt.matches(t, self.roles[i]) {
                    continue;
                }
                match hit {
                    Some((p0, d0)) if d0 != *d => {
                        return Err(PlanError::MapConflict {
                            tensor: t.name.clone(),
                            first: p0.to_string(),
                            first_device: self.devs[d0].name.clone(),
                            second: pat.to_string(),
                            second_device: self.devs[*d].name.clone(),
                        });
                    }
                    Some(_) => {}
                    None => hit = Some((pat, *d)),
                }
            }
            match hit.map(|h| h.1).or(default) {
                Some(d) => a.tensor_dev[i] = d,
                None => missing.push(t.name.as_str()),
            }
        }
        if !missing.is_empty() {
            let shown: Vec<&str> = missing.iter().take(8).copied().collect();
            let more = if missing.len() > 8 {
                format!(" and {} more", missing.len() - 8)
            } else {
                String::new()
            };
            return Err(PlanError::MapIncomplete {
                count: missing.len(),
                tensors: format!("{}{more}", shown.join(", ")),
            });
        }
        // A layer lives where its attention (and so its KV) is.
        for unit in &self.units {
            if let UnitKind::Layer(l) = unit.kind {
                let pick = unit
                    .tensors
                    .iter()
                    .find(|&&t| self.roles[t] == Some(Role::AttnK))
                    .or(unit.tensors.first())
                    .map(|&t| a.tensor_dev[t]);
                let d = pick.unwrap_or(self.host);
                a.layer_dev[l as usize] = d;
                if unit.kv > 0 {
                    a.kv_dev[l as usize] = vec![(d, unit.kv)];
                }
                a.hosts[d].layers = true;
            }
        }
        if let Some(e) = self.embd_tensor {
            a.embed_dev = a.tensor_dev[e];
            a.hosts[a.embed_dev].embed = true;
        }
        let out = self.units.iter().find(|u| u.kind == UnitKind::Output);
        a.head_dev = out
            .and_then(|u| u.tensors.first())
            .map_or(a.embed_dev, |&t| a.tensor_dev[t]);
        a.hosts[a.head_dev].head = true;
        Ok(a)
    }
}

impl Ctx<'_> {
    /// llama.cpp `-ot` rules compiled, each with its device's index.
    pub(super) fn overrides(&self, rules: &[(String, String)]) -> Result<Vec<(Regex, usize)>> {
        rules
            .iter()
            .map(|(pat, dev)| {
                let re = Regex::new(pat).map_err(|e| PlanError::Regex {
                    pattern: pat.clone(),
                    reason: e.to_string(),
                })?;
                Ok((re, resolve_device_in(&self.devs, dev)?))
            })
            .collect()
    }
}

fn resolve_device_in(devs: &[Dev], name: &str) -> Result<usize> {
    let specs: Vec<crate::device::DeviceSpec> = devs
        .iter()
        .map(|d| crate::device::DeviceSpec::new(d.name.clone(), d.kind, d.limit))
        .collect();
    resolve_device(&specs, name, "device_map")
}

/// One device-map key.
enum Matcher {
    Default,
    Layers(u32, u32),
    Role(Role),
    Prefix(String),
}

impl Matcher {
    fn parse(p: &str) -> Matcher {
        let p = p.trim();
        if p.is_empty() || p == "*" {
            return Matcher::Default;
        }
        match p {
            "model.embed_tokens" | "embed_tokens" | "token_embd" => {
                return Matcher::Role(Role::TokenEmbd);
            }
            "model.norm" | "norm" | "output_norm" => return Matcher::Role(Role::OutputNorm),
            "lm_head" | "output" => return Matcher::Role(Role::Output),
            _ => {}
        }
        let body = p.strip_prefix("model.").unwrap_or(p);
        for pre in ["layers.", "blk."] {
            if let Some(rest) = body.strip_prefix(pre) {
                let (a, b) = match rest.split_once('-') {
                    Some((a, b)) => (a, b),
                    None => (rest, rest),
                };
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>())
                    && a <= b
                {
                    return Matcher::Layers(a, b);
                }
            }
        }
        Matcher::Prefix(p.to_string())
    }

    /// Whether the key covers tensor `t`, whose role (see `Ctx::roles`) is `role`.
    fn matches(&self, t: &TensorInfo, role: Option<Role>) -> bool {
        match self {
            Matcher::Default => true,
            Matcher::Layers(a, b) => t.layer.is_some_and(|l| (*a..=*b).contains(&l)),
            Matcher::Role(r) => role == Some(*r) && t.layer.is_none(),
            Matcher::Prefix(p) => {
                t.name == *p
                    || (t.name.starts_with(p.as_str())
                        && t.name.as_bytes().get(p.len()) == Some(&b'.'))
            }
        }
    }
}
