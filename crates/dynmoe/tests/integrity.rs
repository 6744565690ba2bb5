//! Damaged and changing stores: record checksums stop damage from spreading into derived
//! stores or into a forward pass, and a store changed in place under a running model is
//! an error, not garbage or SIGBUS (docs/FORMAT.md, §6, §7 and §9).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use dynmoe::backend::Cpu;
use dynmoe::model::{self, ExpertBits};
use dynmoe::store::lowbit::{self, spot_check_records};
use dynmoe::store::{base, Error, Layout};
use dynmoe::testing::{fixture, TempDir};

fn converted(name: &str) -> TempDir {
    let out = TempDir::new(name);
    base::convert(&fixture(name), out.dir(), &mut |_, _| {}).unwrap();
    out
}

fn bits(b: u32) -> ExpertBits {
    ExpertBits {
        default: Some(b),
        ..ExpertBits::default()
    }
}

fn overwrite(path: &Path, at: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

/// A forward pass over a few tokens of the model in `dir` at `b` bits.
fn forward(dir: &Path, b: u32) -> Result<Vec<f32>, model::Error> {
    let m = model::load_with(dir, Cpu::fast(), &bits(b))?;
    let mut state = m.model.new_state(8);
    m.model.forward(&mut state, &[1, 2, 3, 4], 0)
}

#[test]
fn damaged_base_store_does_not_spread_into_derived_stores() {
    let out = converted("small-moe");
    // The first 4 KiB of experts.bin zeroed: record 0's gate codes.
    overwrite(&out.path("experts.bin"), 0, &[0u8; 4096]);
    let err = lowbit::ensure(out.dir(), 2).unwrap_err();
    assert!(
        matches!(&err, Error::Damaged { path, record: 0, .. } if path.ends_with("experts.bin")),
        "{err}"
    );
    assert!(
        !out.path("experts2.json").exists(),
        "a 2-bit store was committed from damaged records"
    );
    // Loading at 2 bits builds nothing either, and says why.
    let err = forward(out.dir(), 2).unwrap_err().to_string();
    assert!(
        err.contains("experts.bin") && err.contains("record 0") && err.contains("damaged"),
        "{err}"
    );
    // Nor does it run at 4 bits from the damaged records.
    let err = forward(out.dir(), 4).unwrap_err().to_string();
    assert!(
        err.contains("experts.bin") && err.contains("damaged"),
        "{err}"
    );
    let err = lowbit::verify(out.dir(), &[]).unwrap_err().to_string();
    assert!(
        err.contains("experts.bin") && err.contains("record 0"),
        "{err}"
    );
}

#[test]
fn damage_outside_the_spot_check_is_found_by_loading_ensure_and_verify() {
    let out = converted("small-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    let l2 = Layout::new(2, 256, 80).unwrap();
    let l4 = Layout::new(4, 256, 80).unwrap();
    let count = 6 * 32;
    assert!(!spot_check_records(count, l4.record_size, l2.record_size).contains(&1));
    // 0xFF over record 1's scales and biases: NaN weights, before checksums.
    let scales = l2.scale_blocks()[0];
    let at = l2.record_offset(1) + scales.offset as u64;
    overwrite(&out.path("experts2.bin"), at, &vec![0xFF; scales.len]);
    // The spot check does not read record 1; the checksums do.
    assert!(lowbit::check(out.dir(), 2).is_ok());
    let err = forward(out.dir(), 2).unwrap_err().to_string();
    assert!(
        err.contains("experts2.bin") && err.contains("record 1 ") && err.contains("damaged"),
        "{err}"
    );
    let err = lowbit::verify(out.dir(), &[2]).unwrap_err().to_string();
    assert!(
        err.contains("experts2.bin") && err.contains("record 1 "),
        "{err}"
    );
    let done = lowbit::ensure_many(out.dir(), &[2]).unwrap();
    assert!(done[0].built, "store ensure kept a damaged store");
    assert!(done[0].reason.as_deref().unwrap().contains("damaged"));
    assert_eq!(lowbit::verify(out.dir(), &[]).unwrap().len(), 2);
    let logits = forward(out.dir(), 2).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// The model in `dir` at `b` bits, after a first forward call.
fn running(dir: &Path, b: u32) -> (model::LoadedModel<Cpu>, model::State<Cpu>) {
    let m = model::load_with(dir, Cpu::fast(), &bits(b)).unwrap();
    let mut state = m.model.new_state(16);
    m.model.forward(&mut state, &[1, 2], 0).unwrap();
    (m, state)
}

/// A forward call of `m` refused, naming `file` as changed.
fn refused_as_changed(m: &model::LoadedModel<Cpu>, state: &mut model::State<Cpu>, file: &str) {
    let err = m.model.forward(state, &[3], 0).unwrap_err().to_string();
    assert!(err.contains(file) && err.contains("changed"), "{err}");
}

#[test]
fn store_changed_under_a_running_model_is_an_error_not_garbage_or_sigbus() {
    let out = converted("tiny-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    let path = out.path("experts2.bin");
    let (m, mut state) = running(out.dir(), 2);

    // `cp other experts2.bin`: the same file rewritten in place.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    std::fs::write(&path, &bytes).unwrap();
    refused_as_changed(&m, &mut state, "experts2.bin");

    // `truncate -s 0`: reading the mapping now would be SIGBUS.
    let (m, mut state) = running(out.dir(), 4);
    OpenOptions::new()
        .write(true)
        .open(out.path("experts.bin"))
        .unwrap()
        .set_len(0)
        .unwrap();
    refused_as_changed(&m, &mut state, "experts.bin");
}

#[test]
fn store_replaced_by_a_writer_under_a_running_model_is_not_a_change() {
    // A writer renames a new file over the old one: the mapping keeps the old file, whose
    // change time moves as it loses its name; that is no reason to stop.
    let out = converted("tiny-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    let (m, mut state) = running(out.dir(), 2);
    let mut policy = lowbit::Policy {
        force: true,
        progress: &mut |_, _| {},
        notice: &mut |_| {},
    };
    let rebuilt = lowbit::ensure_with_policy(out.dir(), &[2], &mut policy).unwrap();
    assert!(rebuilt[0].built);
    m.model.forward(&mut state, &[3], 0).unwrap();
}

/// What checking records costs a load (`cargo test -p dynmoe --test integrity --
/// --ignored --nocapture`): small-moe's 4-bit and 2-bit stores opened, then the first
/// `check_stores` (every layer's records hashed, once) and a later one (the file stamps
/// only). docs/notes/hardening-2026-12-04.md records the numbers.
#[test]
#[ignore]
fn load_time_with_record_checksums() {
    let out = converted("small-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    for b in [4, 2] {
        let t = std::time::Instant::now();
        let m = model::load_with(out.dir(), Cpu::fast(), &bits(b)).unwrap();
        let load = t.elapsed();
        let t = std::time::Instant::now();
        m.model.check_stores().unwrap();
        let first = t.elapsed();
        let t = std::time::Instant::now();
        m.model.check_stores().unwrap();
        let later = t.elapsed();
        let bytes = std::fs::metadata(out.path(&dynmoe::store::data_file_name(b)))
            .unwrap()
            .len();
        println!(
            "{b}-bit: load {:.1} ms, first check {:.2} ms ({:.0} MB, {:.2} GB/s), later check {:.1} us",
            load.as_secs_f64() * 1e3,
            first.as_secs_f64() * 1e3,
            bytes as f64 / 1e6,
            bytes as f64 / first.as_secs_f64() / 1e9,
            later.as_secs_f64() * 1e6
        );
    }
}
