// Independent Java model of Metaq 1.4's partition assignment, for golden data.
//
// Written from the behaviour of killme2008/Metamorphosis (DefaultLoadBalanceStrategy,
// ConsisHashStrategy, HashAlgorithm.KETAMA_HASH, ByteUtils.getBytes and the caller in
// ConsumerZooKeeper / MetaZookeeper): consumers are Collections.sort-ed, partitions are
// de-duplicated then Collections.sort-ed, strings are hashed as getBytes("utf-8").
// tests/test_assignors.py compiles it with javac, runs it with java and compares its
// answers with metaq.consumer._assignors.
//
// Strings travel as hex of their UTF-16 code units so that any Java string, lone
// surrogates included, survives the trip.  Lists are comma-separated, "-" when empty.
// Commands, one per stdin line; one answer line each (CASE: one line per consumer and
// strategy):
//   SORT <list>              -> SORT <list sorted by String.compareTo>
//   UTF8 <str>               -> UTF8 <hex of str.getBytes("utf-8")>
//   HASH <str>               -> HASH <ketama hash, decimal>
//   CASE <id> <consumers> <partitions>
//                            -> DEFAULT <id> <consumer> <share>   (share in Java's order)
//                               CONSIST <id> <consumer> <share>
//                               END <id>

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;

public class AssignGolden {

    static String decode(String hex) {
        char[] units = new char[hex.length() / 4];
        for (int i = 0; i < units.length; i++) {
            units[i] = (char) Integer.parseInt(hex.substring(4 * i, 4 * i + 4), 16);
        }
        return new String(units);
    }

    static String encode(String s) {
        StringBuilder sb = new StringBuilder();
        for (int i = 0; i < s.length(); i++) {
            sb.append(String.format("%04x", (int) s.charAt(i)));
        }
        return sb.toString();
    }

    static List<String> decodeList(String field) {
        List<String> out = new ArrayList<>();
        if (!field.equals("-")) {
            for (String h : field.split(",")) {
                out.add(decode(h));
            }
        }
        return out;
    }

    static String encodeList(List<String> list) {
        if (list.isEmpty()) {
            return "-";
        }
        StringBuilder sb = new StringBuilder();
        for (String s : list) {
            if (sb.length() > 0) {
                sb.append(',');
            }
            sb.append(encode(s));
        }
        return sb.toString();
    }

    static byte[] md5(String s) throws Exception {
        MessageDigest md = MessageDigest.getInstance("MD5");
        md.update(s.getBytes("utf-8"));
        return md.digest();
    }

    static long le32(byte[] d, int off) {
        return ((long) (d[off + 3] & 0xFF) << 24) | ((long) (d[off + 2] & 0xFF) << 16)
                | ((long) (d[off + 1] & 0xFF) << 8) | (long) (d[off] & 0xFF);
    }

    static long ketama(String s) throws Exception {
        return le32(md5(s), 0);
    }

    // Range assignment, as DefaultLoadBalanceStrategy.getPartitions.
    static List<String> range(String me, List<String> consumers, List<String> parts) {
        int per = parts.size() / consumers.size();
        int extra = parts.size() % consumers.size();
        int pos = consumers.indexOf(me);
        List<String> out = new ArrayList<>();
        if (pos < 0) {
            return out;
        }
        int start = per * pos + Math.min(pos, extra);
        int count = per + (pos + 1 > extra ? 0 : 1);
        for (int i = start; i < start + count; i++) {
            out.add(parts.get(i));
        }
        return out;
    }

    // Consistent hash, as ConsisHashStrategy.getPartitions with KETAMA_HASH.
    static List<String> consist(String me, List<String> consumers, List<String> parts)
            throws Exception {
        TreeMap<Long, String> ring = new TreeMap<>();
        for (String c : consumers) {
            for (int i = 0; i < 160 / 4; i++) {
                byte[] d = md5(c + "-" + i);
                for (int h = 0; h < 4; h++) {
                    ring.put(le32(d, 4 * h), c);
                }
            }
        }
        Set<String> mine = new HashSet<>();
        for (String p : parts) {
            Map.Entry<Long, String> e = ring.ceilingEntry(ketama(p));
            if (e == null) {
                e = ring.firstEntry();
            }
            if (e.getValue().equals(me)) {
                mine.add(p);
            }
        }
        return new ArrayList<>(mine);
    }

    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        PrintStream out = new PrintStream(System.out, false, "US-ASCII");
        String line;
        while ((line = in.readLine()) != null) {
            line = line.trim();
            if (line.isEmpty()) {
                continue;
            }
            String[] f = line.split(" ");
            switch (f[0]) {
            case "SORT": {
                List<String> l = decodeList(f[1]);
                Collections.sort(l);
                out.println("SORT " + encodeList(l));
                break;
            }
            case "UTF8": {
                StringBuilder sb = new StringBuilder();
                for (byte b : decode(f[1]).getBytes("utf-8")) {
                    sb.append(String.format("%02x", b & 0xFF));
                }
                out.println("UTF8 " + sb);
                break;
            }
            case "HASH":
                out.println("HASH " + ketama(decode(f[1])));
                break;
            case "CASE": {
                String id = f[1];
                List<String> consumers = decodeList(f[2]);
                Collections.sort(consumers);
                List<String> parts = new ArrayList<>();
                for (String p : decodeList(f[3])) {
                    if (!parts.contains(p)) {
                        parts.add(p);
                    }
                }
                Collections.sort(parts);
                for (String c : consumers) {
                    String ch = encode(c);
                    out.println("DEFAULT " + id + " " + ch + " " + encodeList(range(c, consumers, parts)));
                    out.println("CONSIST " + id + " " + ch + " " + encodeList(consist(c, consumers, parts)));
                }
                out.println("END " + id);
                break;
            }
            default:
                throw new IllegalArgumentException("unknown command: " + f[0]);
            }
        }
        out.flush();
    }
}
