//! Offloaded execution (`offload="sequential" | "group"`): layers whose weights stay on `cpu`
//! or `disk` run on the execution device, their matrices copied into onload slots there first.
//! The slots are the tail of that device's planned scratch, after its workspace, so what the
//! plan counted is what is held. With two slots the next group is copied by a scoped thread
//! while the current one computes (a copy stream's work on a GPU); a slot keeps its group
//! across forward calls, so a model with as many groups as slots copies each only once.

use std::time::Instant;

use crate::device::pace;
use crate::error::{Result, invalid};
use crate::model::Held;

use super::Copies;
use super::graph::{Layer, weight_of};

/// The onload state of a graph.
#[derive(Debug)]
pub(crate) struct Onload {
    /// The site the offloaded layers compute on.
    pub site: usize,
    /// Layer indices per group, in execution order.
    pub groups: Vec<Vec<usize>>,
    pub slot_bytes: usize,
    /// The group each slot holds now; one entry per slot.
    pub holds: Vec<Option<usize>>,
    /// The simulated link rate from where the weights are to the execution device.
    pub rate: Option<u64>,
}

impl Onload {
    pub fn slots(&self) -> usize {
        self.holds.len()
    }

    /// Bytes of every slot together.
    pub fn bytes(&self) -> usize {
        self.slot_bytes * self.slots()
    }

    /// Lay out each group's matrices in a slot: sets `Layer::group` and every matrix's offset,
    /// checking that the largest group fits the planned slot.
    pub fn assign(&self, layers: &mut [Layer], held: &[Held]) -> Result<()> {
        for (g, group) in self.groups.iter().enumerate() {
            let mut at = 0usize;
            for &li in group {
                let layer = layers
                    .get_mut(li)
                    .ok_or_else(|| invalid("offloaded layer", "a layer of the model", li))?;
                layer.group = Some(g);
                for lin in layer.linears_mut() {
                    let Some(Held::Whole { tensor, .. }) = held.get(lin.index()) else {
                        return Err(invalid(
                            format!("offloaded tensor '{}'", lin.name),
                            "a whole tensor held by the model",
                            "a split or missing one",
                        ));
                    };
                    lin.onload_at = Some(at);
                    at += tensor.nbytes() as usize;
                }
            }
            if at > self.slot_bytes {
                return Err(invalid(
                    format!("onload group {g}"),
                    format!("at most the planned slot of {} bytes", self.slot_bytes),
                    format!("{at} bytes of matrices; the plan was made for other weights"),
                ));
            }
        }
        Ok(())
    }

    /// Where each matrix of group `g` comes from and where it goes in the slot.
    pub fn parts<'a>(
        &self,
        g: usize,
        layers: &[Layer],
        held: &'a [Held],
        copies: &'a [(usize, Held)],
    ) -> Result<Vec<(&'a [u8], usize)>> {
        let mut out = Vec::new();
        for &li in &self.groups[g] {
            for lin in layers[li].linears() {
                let (src, _) = weight_of(held, copies, lin, None)?;
                out.push((src, lin.onload_at.unwrap_or(0)));
            }
        }
        Ok(out)
    }
}

/// Copy `parts` into `slot`, paced by the link rate. Returns the copy's count, bytes and time.
pub(crate) fn fill(parts: &[(&[u8], usize)], slot: &mut [u8], rate: Option<u64>) -> Result<Copies> {
    let since = Instant::now();
    let mut bytes = 0u64;
    let len = slot.len();
    for &(src, at) in parts {
        let dst = slot.get_mut(at..at + src.len()).ok_or_else(|| {
            invalid(
                "onload copy",
                format!("{} bytes in the slot from offset {at}", src.len()),
                format!("a slot of {len} bytes"),
            )
        })?;
        dst.copy_from_slice(src);
        bytes += src.len() as u64;
    }
    pace(rate, bytes, since);
    let mut c = Copies::default();
    c.note(bytes, since);
    Ok(c)
}
