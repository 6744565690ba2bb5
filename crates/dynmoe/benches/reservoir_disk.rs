//! Streaming experts from a cold disk: the disk reservoir's reads (`O_DIRECT` where the
//! file system takes it) against plain `pread`s of the same records, with the file
//! evicted from the page cache before each cold pass (`posix_fadvise(DONTNEED)` after an
//! fsync), and plain reads once the cache holds the file, which is what a reservoir
//! reading through the cache measures after its first pass.
//!
//! The store is a file of Qwen3-30B-A3B-sized 2-bit expert records (random bytes, 1.4 MB
//! each, two layers of 128) under `target/`, written once. Each pass reads every record
//! in a shuffled order (as swaps ask for them), on one thread, the way a loader does;
//! passes take turns over three rounds and the table gives each one's median. Prints a
//! table and writes `bench/results/reservoir_disk.json`.
//!
//! `cargo bench -p dynmoe --bench reservoir_disk`

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dynmoe::checkpoint::experts::Extent;
use dynmoe::residency::{Reservoir, ReservoirKind};
use dynmoe::rng::Rng;
use dynmoe::store::layout::Layout;
use dynmoe::store::records::{LayerSource, RecordFormat};
use serde::Serialize;

const LAYERS: usize = 2;
const EXPERTS: usize = 128;
const ROUNDS: usize = 3;

#[derive(Serialize)]
struct Pass {
    name: &'static str,
    cold: bool,
    mb_s: Vec<f64>,
    median_mb_s: f64,
    ms_per_record: f64,
}

#[derive(Serialize)]
struct Report {
    file: String,
    file_system_direct: bool,
    record_bytes: usize,
    records: usize,
    rounds: usize,
    passes: Vec<Pass>,
}

/// Drops the file's pages from the page cache (they are clean after the fsync).
fn evict(path: &Path) {
    let f = File::open(path).expect("store");
    f.sync_all().expect("fsync");
    // SAFETY: a valid descriptor; the call only advises the kernel.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise on {}", path.display());
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let layout = Layout::new(2, 2048, 768).expect("layout");
    let record = layout.record_size;
    let path = root.join("target/reservoir_disk/experts2.bin");
    let records = LAYERS * EXPERTS;
    let size = (layout.record_offset(records) as usize).max(records * record);
    if std::fs::metadata(&path).map(|m| m.len() as usize).ok() != Some(size) {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        let mut rng = Rng::seeded(7);
        let mut f = File::create(&path).expect("create");
        let mut block = vec![0u8; 1 << 20];
        for _ in 0..size.div_ceil(block.len()) {
            for b in block.chunks_mut(8) {
                b.copy_from_slice(&rng.next_u64().to_le_bytes()[..b.len()]);
            }
            f.write_all(&block).expect("write");
        }
        f.set_len(size as u64).expect("truncate");
    }
    let sources: BTreeMap<usize, LayerSource> = (0..LAYERS)
        .map(|layer| {
            let experts = (0..EXPERTS)
                .map(|e| {
                    vec![Extent {
                        file: path.clone(),
                        offset: layout.record_offset(layer * EXPERTS + e),
                        len: record,
                    }]
                })
                .collect();
            let source = LayerSource {
                format: RecordFormat::Affine(layout),
                experts,
                checksums: None,
            };
            (layer, source)
        })
        .collect();
    let reservoir = Reservoir::open(ReservoirKind::Disk, &sources).expect("reservoir");
    let mut order: Vec<(usize, usize)> = (0..LAYERS)
        .flat_map(|l| (0..EXPERTS).map(move |e| (l, e)))
        .collect();
    let mut rng = Rng::seeded(11);
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let plain = File::open(&path).expect("open");
    let mut buf = RecordFormat::Affine(layout).buffer();
    let (mut scratch, mut bytes) = (Vec::new(), vec![0u8; record]);
    let mut read_all = |name: &str| {
        let t = Instant::now();
        for &(l, e) in &order {
            match name {
                "reservoir" => {
                    reservoir.read(l, e, &mut buf, &mut scratch).expect("read");
                }
                _ => plain
                    .read_exact_at(&mut bytes, sources[&l].experts[e][0].offset)
                    .expect("pread"),
            }
        }
        t.elapsed().as_secs_f64()
    };
    let passes: [(&'static str, &str, bool); 4] = [
        ("reservoir (direct), cold cache", "reservoir", true),
        ("plain pread, cold cache", "plain", true),
        ("plain pread, file cached", "plain", false),
        ("reservoir (direct), file cached", "reservoir", false),
    ];
    let mut times = vec![Vec::new(); passes.len()];
    for _ in 0..ROUNDS {
        for (i, &(_, how, cold)) in passes.iter().enumerate() {
            if cold {
                evict(&path);
            } else {
                read_all("plain"); // the file in the cache
            }
            times[i].push(read_all(how));
        }
    }
    let mb = (records * record) as f64 / 1e6;
    let report = Report {
        file: "target/reservoir_disk/experts2.bin".into(),
        file_system_direct: reservoir.reads_direct(),
        record_bytes: record,
        records,
        rounds: ROUNDS,
        passes: passes
            .iter()
            .zip(&times)
            .map(|(&(name, _, cold), t)| {
                let s = median(t.clone());
                Pass {
                    name,
                    cold,
                    mb_s: t.iter().map(|s| mb / s).collect(),
                    median_mb_s: mb / s,
                    ms_per_record: s * 1e3 / records as f64,
                }
            })
            .collect(),
    };
    println!(
        "{} records of {} bytes ({:.0} MB), O_DIRECT taken: {}",
        records, record, mb, report.file_system_direct
    );
    println!("{:<34} {:>10} {:>14}", "pass", "MB/s", "ms a record");
    for p in &report.passes {
        println!(
            "{:<34} {:>10.0} {:>14.3}",
            p.name, p.median_mb_s, p.ms_per_record
        );
    }
    let out = root.join("bench/results/reservoir_disk.json");
    std::fs::write(&out, serde_json::to_string_pretty(&report).expect("json"))
        .expect("write results");
    println!("wrote {}", out.display());
}
